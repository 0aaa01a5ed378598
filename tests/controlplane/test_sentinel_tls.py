"""Issue 24, item 8: sentinels inside the trust boundary.

- `rediss+sentinel://` against real TLS-only sentinels and data nodes (Debian's
  redis-server 7, built with TLS): the store commits, follows a failover, and the
  CLI works with `--redis-ca-file`, which is honoured for the sentinels and the
  primary alike;
- a password-less fake sentinel on 127.0.0.1 (a raw TCP server recording every byte;
  it names a second recorder as the primary) never receives the data password: with
  `redis+sentinel://` the password goes only to the primary it names (the documented
  limit: a sentinel picks the primary), and with `rediss+sentinel://` neither fake
  gets anything but a TLS handshake it cannot complete.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.redisserver import RedisServerError, RedisTls
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store, StoreError
from tests.controlplane.test_redis_access import redis7  # noqa: F401 (fixture)
from tests.support.cli import sluice
from tests.support.poll import retrying
from tests.support.ports import HOST
from tests.support.sentinel import SentinelGroup
from tests.support.tls import redis_tls

PASSWORD = "data-pw-for-tests"


@pytest.fixture
def certs(tmp_path: Path) -> RedisTls:
    return redis_tls(tmp_path / "certs")


@pytest.fixture
def tls_group(redis7: str, certs: RedisTls, tmp_path: Path) -> Iterator[SentinelGroup]:  # noqa: F811
    group = SentinelGroup(tmp_path / "group", password=PASSWORD, tls=certs, binary=redis7)
    try:
        group.start()
    except RedisServerError as exc:
        group.stop()
        if "tls" in str(exc).lower() or "Bad directive" in str(exc):
            pytest.skip(f"{redis7} is not built with TLS: {str(exc)[-200:]}")
        raise
    try:
        yield group
    finally:
        group.stop()


@pytest.mark.slow
async def test_store_and_cli_through_tls_sentinels(
    tls_group: SentinelGroup, certs: RedisTls, redis_prefix: str
) -> None:
    url = tls_group.url
    assert url.startswith("rediss+sentinel://")
    # Without the CA the sentinels' certificates are not trusted: no connection at all.
    async with Store.from_url(url, prefix=redis_prefix, socket_timeout=2.0) as store:
        with pytest.raises(StoreError):
            await store.ping()
    async with Store.from_url(url, prefix=redis_prefix, socket_timeout=2.0,
                              ca_file=certs.cafile) as store:  # fmt: skip
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")  # fmt: skip
        ready = ReplicaRecord(id=1, status=ReplicaStatus.READY, url="http://127.0.0.1:23001")
        first = await store.commit("svc", replica_updates=[ready])
        await store._redis.wait(1, 5000)
        await asyncio.to_thread(tls_group.failover)
        second = await retrying(lambda: store.commit("svc", replica_updates=[
            ReplicaRecord(id=2, status=ReplicaStatus.READY, url="http://127.0.0.1:23002")]),
            on=(StoreError,))  # fmt: skip
        assert second.generation == first.generation + 1
    result = await asyncio.to_thread(
        sluice, "snapshot", "svc", "--prefix", redis_prefix, "--redis-ca-file", certs.cafile,
        env={"SLUICE_REDIS_URL": url})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "127.0.0.1:23002" in result.output and PASSWORD not in result.output


# -- a fake sentinel ---------------------------------------------------------------------------


class Recorder:
    """A raw TCP server on 127.0.0.1 that records every byte and answers RESP: as a
    sentinel it names `primary_port` as the primary of every service; as anything else
    it answers +OK."""

    def __init__(self, primary_port: int | None = None) -> None:
        self.received = bytearray()
        self.primary_port = primary_port
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Recorder:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
            while True:
                first = await reader.read(1)
                if not first:
                    break
                self.received += first
                if first != b"*":
                    self.received += await reader.read(65536)
                    break  # a TLS ClientHello: nothing it can answer
                command = await self._command(reader)
                writer.write(self._answer(command))
                await writer.drain()
        writer.close()

    async def _command(self, reader: asyncio.StreamReader) -> list[bytes]:
        """One RESP command (its leading `*` already read)."""
        line = await reader.readline()
        self.received += line
        args = []
        for _ in range(int(line)):
            head = await reader.readline()
            body = await reader.readexactly(int(head[1:]) + 2)
            self.received += head + body
            args.append(body[:-2])
        return args

    def _answer(self, command: list[bytes]) -> bytes:
        name = b" ".join(command[:2]).upper()
        if name.startswith(b"HELLO"):
            return b"%1\r\n$5\r\nproto\r\n:3\r\n"  # RESP3 from here on (redis-py 8)
        if name == b"SENTINEL MASTERS" and self.primary_port is not None:
            fields = ["name", "sluice", "ip", HOST, "port", str(self.primary_port),
                      "flags", "master", "num-other-sentinels", "0"]  # fmt: skip
            body = b"".join(b"$%d\r\n%s\r\n" % (len(f), f.encode()) for f in fields)
            return b"*1\r\n%%%d\r\n" % (len(fields) // 2) + body
        return b"+OK\r\n"


@pytest.fixture
async def fakes() -> AsyncIterator[tuple[Recorder, Recorder]]:
    async with Recorder() as primary, Recorder(primary_port=primary.port) as sentinel:
        primary.primary_port = None
        yield sentinel, primary


@pytest.mark.parametrize("scheme", ["redis+sentinel", "rediss+sentinel"])
async def test_a_password_less_fake_sentinel_never_receives_the_password(
    fakes: tuple[Recorder, Recorder], certs: RedisTls, scheme: str
) -> None:
    sentinel, primary = fakes
    url = f"{scheme}://sluice-proxy-llm:{PASSWORD}@{HOST}:{sentinel.port}/sluice/0"
    ca = certs.cafile if scheme == "rediss+sentinel" else None
    async with Store.from_url(url, socket_timeout=2.0, ca_file=ca) as store:
        with contextlib.suppress(StoreError):
            await store.ping()
    assert sentinel.received, "the client never asked the sentinel"
    assert PASSWORD.encode() not in sentinel.received, bytes(sentinel.received)
    if scheme == "rediss+sentinel":
        assert not sentinel.received.startswith(b"*")  # a TLS handshake, no command
        assert PASSWORD.encode() not in primary.received


def test_the_ca_file_is_accepted_for_tls_sentinel_urls_only(certs: RedisTls) -> None:
    ok = sluice("status", "--redis-ca-file", certs.cafile,
                env={"SLUICE_REDIS_URL": f"rediss+sentinel://{HOST}:1/sluice"})  # fmt: skip
    assert "needs a rediss://" not in ok.output
    refused = sluice("status", "--redis-ca-file", certs.cafile,
                     env={"SLUICE_REDIS_URL": f"redis+sentinel://{HOST}:1/sluice"})  # fmt: skip
    assert refused.exit_code != 0 and "rediss+sentinel://" in refused.output

