"""Issue 24, item 1 (fill-Redis): the proxy ACL user fills a Redis run as docs/redis.md
advises (`maxmemory`, `noeviction`, `proto-max-bulk-len 8mb`) through its in-flight
hash; commits are refused at maxmemory; the controller (as sluice-controller) deletes
the oversize hash unread, before any commit of its own, and commits work again.
Against a real redis-server 7 with the documented ACL users."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from controlplane import ops
from controlplane.redisserver import EmbeddedRedis
from controlplane.servicespec import parse_spec
from controlplane.store import Store, StoreError
from tests.controlplane.test_redis_access import (  # noqa: F401 (fixtures)
    CONTROLLER_PASSWORD,
    PROXY_PASSWORD,
    _user_url,
    controller,
    documented_users,
    redis7,
)
from tests.support.poll import until

HEADROOM = 24 * 1024 * 1024
VALUE = b"x" * (8 * 1024 * 1024 - 64)  # just under proto-max-bulk-len


@pytest.fixture
def acl_server(redis7: str, tmp_path: Path) -> Iterator[EmbeddedRedis]:  # noqa: F811
    """The documented ACL users on a Redis with maxmemory a little above what it uses."""
    def above_use(admin: redis.Redis) -> None:
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", str(used + HEADROOM))

    options = [("maxmemory-policy", "noeviction"), ("proto-max-bulk-len", "8mb")]
    yield from documented_users(redis7, tmp_path, options, above_use)


@pytest.mark.slow
async def test_a_redis_filled_through_the_proxy_user_gets_its_memory_back(
    acl_server: EmbeddedRedis,
    controller: asyncio.Task[None],  # noqa: F811
) -> None:
    controller_url = _user_url(acl_server, "sluice-controller", CONTROLLER_PASSWORD)
    spec = parse_spec({"service": {"readiness_probe": "/health", "replicas": 1}})
    as_proxy = aioredis.Redis.from_url(_user_url(acl_server, "sluice-proxy-llm", PROXY_PASSWORD))
    try:
        async with Store.from_url(controller_url) as store:
            await ops.up(store, "llm", spec)
            # Its first step polices the hashes; the next is RPS_TRIM_INTERVAL_SECONDS
            # (10 s) later, far more than the fill and the refused commit below take.
            await ops.wait_for(store, "llm", lambda v: v.status != "CONTROLLER_INIT",
                               timeout=20)  # fmt: skip
            # Fill: 8 MB values (the bulk limit) until Redis refuses one.
            for i in range(16):
                try:
                    await as_proxy.hset("sluice:svc:llm:inflight", f"p{i}", VALUE)
                except redis.exceptions.OutOfMemoryError:
                    break
            else:
                pytest.fail("Redis never refused a value")
            # Redis shrinks idle query buffers (megabytes after such writes) on its own
            # timer, which would end the OOM state by chance: free the writer's buffer
            # (it disconnects) and pin maxmemory just below what the data uses, as a
            # Redis filled to the byte would be.
            await as_proxy.aclose()
            admin = aioredis.Redis.from_url(acl_server.url)
            try:
                await until(lambda: _clients(admin, 1), timeout=10, what="the writer gone")
                used = int((await admin.info("memory"))["used_memory"])
                await admin.config_set("maxmemory", str(used - (2 << 20)))
            finally:
                await admin.aclose()
            with pytest.raises(StoreError, match="maxmemory"):
                await ops.add_replica(store, "llm", "http://127.0.0.1:1")

            async def committed() -> bool:
                try:
                    await ops.add_replica(store, "llm", "http://127.0.0.1:1")
                except StoreError:
                    return False
                return True

            await until(committed, timeout=40, interval=0.5, what="a commit after the fill")
            assert await store._redis.exists("sluice:svc:llm:inflight") == 0
        assert not controller.done()
    finally:
        await as_proxy.aclose()


async def _clients(admin: aioredis.Redis, at_most: int) -> bool:
    """At most `at_most` clients of the proxy user (0) are connected."""
    listed = await admin.client_list()
    return sum(1 for c in listed if c.get("user") == "sluice-proxy-llm") < at_most
