"""controlplane.redisserver.EmbeddedRedis: a private redis-server, started and stopped by pid."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from controlplane.redisserver import EmbeddedRedis, RedisServerError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_answer_and_stop() -> None:
    with EmbeddedRedis() as server:
        pid = server.pid
        assert pid is not None and server.port is not None
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        state_dir = server.state_dir
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
    assert server.pid is None and not _alive(pid)
    assert not state_dir.exists()  # a temporary state dir goes with the server


def test_restart_keeps_the_port_and_persist_keeps_the_data(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "state", persist=True) as server:
        url = server.url
        with redis.Redis.from_url(url) as client:
            client.set("k", "v")
        first = server.pid
        assert first is not None
        server.kill()
        assert server.pid is None and not _alive(first)
        server.restart()
        assert server.url == url and server.pid != first
        with redis.Redis.from_url(url) as client:
            assert client.get("k") == b"v"  # fsynced before the SIGKILL
    assert (tmp_path / "state").is_dir()  # a given state dir is kept


def test_unix_socket_with_password() -> None:
    with EmbeddedRedis(unix_socket=True, password="p@ss:w/rd") as server:
        assert server.port is None and server.url.startswith("unix://")
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        with redis.Redis.from_url(server.url.replace("p%40ss", "nope")) as client:
            with pytest.raises(redis.AuthenticationError):
                client.ping()


def test_a_server_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RedisServerError, match="exited"):
        EmbeddedRedis(tmp_path, binary="/bin/false").start()
    with EmbeddedRedis() as taken:
        clash = EmbeddedRedis(tmp_path, port=taken.port)
        with pytest.raises(RedisServerError, match="Address already in use"):
            clash.start()
        assert clash.pid is None
