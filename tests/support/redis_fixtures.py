"""Real redis-server fixtures; no mock Redis anywhere.

``redis_server`` (session): one EmbeddedRedis on a free port for the whole run.
``redis_url``: its URL.
``redis_prefix``: a key prefix unique to the test; its keys are deleted afterwards.
``redis_client``: a connected ``redis.asyncio.Redis`` (bytes responses), closed at teardown.
``store``: a ``controlplane.store.Store`` on ``redis_client`` with ``redis_prefix``.
``redis_factory(**kwargs)``: a private EmbeddedRedis (for tests that SIGKILL or
restart Redis, or need a password); every one is stopped at teardown.
``sentinel_factory(**kwargs)``: a private SentinelGroup (primary, replica, three
sentinels; `redis-server --sentinel`), stopped at teardown; skips the test when no
sentinel-capable redis-server exists.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from controlplane.redisserver import EmbeddedRedis, RedisServerError, find_redis_server
from controlplane.store import Store
from tests.support.sentinel import SentinelGroup

_counter = itertools.count(1)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"t{next(_counter)}-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.ConnectionError:
        pass  # the server is gone with its keys
    finally:
        client.close()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def store(redis_client: aioredis.Redis, redis_prefix: str) -> Store:
    return Store(redis_client, prefix=redis_prefix)


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., EmbeddedRedis]]:
    servers: list[EmbeddedRedis] = []

    def start(**kwargs: Any) -> EmbeddedRedis:
        kwargs.setdefault("state_dir", tmp_path / f"redis{len(servers)}")
        server = EmbeddedRedis(**kwargs)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in reversed(servers):
        with contextlib.suppress(Exception):
            server.stop()


@pytest.fixture
def sentinel_factory(tmp_path: Path) -> Iterator[Callable[..., SentinelGroup]]:
    groups: list[SentinelGroup] = []

    def start(**kwargs: Any) -> SentinelGroup:
        try:
            find_redis_server()
        except RedisServerError as exc:
            pytest.skip(f"no sentinel-capable redis-server: {exc}")
        group = SentinelGroup(tmp_path / f"sentinel{len(groups)}", **kwargs)
        groups.append(group)
        try:
            group.start()
        except RedisServerError as exc:
            if "sentinel" in str(exc).lower() and "FATAL" in str(exc):
                pytest.skip(f"this redis-server cannot run as a sentinel: {exc}")
            raise
        return group

    yield start
    for group in reversed(groups):
        with contextlib.suppress(Exception):
            group.stop()
