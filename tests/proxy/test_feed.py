"""proxy.wire.feed: the one implementation of "subscribe, confirm, GET, follow, re-GET",
against a real redis-server (and, for the one case a real server cannot show, a fake
that never confirms a subscription)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from proxy.wire.feed import NoSubscribeConfirmation, SnapshotFeed, newer_snapshots
from proxy.wire.keys import Keys
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot, encode_snapshot

SERVICE = "feed"


def snap(generation: int, *, service: str = SERVICE) -> bytes:
    return encode_snapshot(ReadySnapshot(
        service=service, generation=generation, published_at=0.0, active_versions=[1],
        replicas=(ReadyReplica(id=1, url=f"http://127.0.0.1:{1000 + generation}"),)))


async def test_feed_reads_the_stored_snapshot_then_published_ones_then_re_gets(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    keys = Keys(redis_prefix)
    await redis_client.set(keys.snapshot(SERVICE), snap(1))
    feed = SnapshotFeed(redis_client, keys, SERVICE, resync_interval=0.3)
    try:
        await feed.subscribe(5.0)
        assert await feed.get() == snap(1)
        # Subscribed before the GET: a publish now is delivered, tagged as published.
        await redis_client.publish(keys.ready(SERVICE), snap(2))
        async with asyncio.timeout(10):
            delivery = None
            while delivery is None:
                delivery = await feed.next()
        assert delivery.payload == snap(2) and delivery.via_publish
        # Stored without a publish (a lost message): the re-GET finds it.
        await redis_client.set(keys.snapshot(SERVICE), snap(3))
        async with asyncio.timeout(10):
            delivery = None
            while delivery is None:
                delivery = await feed.next()
        assert delivery.payload == snap(3) and not delivery.via_publish
    finally:
        await feed.aclose()
    await feed.aclose()  # twice is harmless


async def test_newer_snapshots_yields_newer_valid_ones_and_skips_the_rest(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    keys = Keys(redis_prefix)
    await redis_client.set(keys.snapshot(SERVICE), snap(2))
    stream = newer_snapshots(redis_client, keys, SERVICE, resync_interval=30.0,
                             subscribe_timeout=5.0)
    try:
        async with asyncio.timeout(10):
            assert (await anext(stream)).generation == 2
            for payload in (b"{not json", snap(1), snap(2), snap(5)):  # bad, stale, same, newer
                await redis_client.publish(keys.ready(SERVICE), payload)
            assert (await anext(stream)).generation == 5
    finally:
        await stream.aclose()


class NeverConfirms:
    """A fake Redis server: answers +OK to every command but SUBSCRIBE, which it never
    confirms (a real server always does; this is the case the timeout is for)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> NeverConfirms:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readline()  # *N
                if not header:
                    return
                args = []
                for _ in range(int(header[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                if args[0].upper() != b"SUBSCRIBE":
                    writer.write(b"+OK\r\n")
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


@pytest.fixture
async def never_confirms() -> AsyncIterator[aioredis.Redis]:
    async with NeverConfirms() as fake:
        client = aioredis.Redis(host="127.0.0.1", port=fake.port, socket_timeout=5)
        yield client
        await client.aclose()


async def test_no_subscribe_confirmation_is_an_error(never_confirms: aioredis.Redis) -> None:
    feed = SnapshotFeed(never_confirms, Keys("x"), SERVICE, resync_interval=1.0)
    with pytest.raises(asyncio.TimeoutError):
        await feed.subscribe(0.2)
    await feed.aclose()
    stream = newer_snapshots(never_confirms, Keys("x"), SERVICE, resync_interval=1.0,
                             subscribe_timeout=0.2)
    with pytest.raises(NoSubscribeConfirmation, match="no subscribe confirmation"):
        async with asyncio.timeout(10):
            await anext(stream)
