"""Issue 24, item 1, end to end: logged in as the documented proxy ACL user
(docs/redis.md), write what a hostile proxy would (a field that is not UTF-8, a
401-digit count, a negative count, a proxy id made of terminal escapes, garbage nudges)
while a real controller (as sluice-controller) runs a QPS-autoscaled service of real
local replicas: the controller keeps reconciling, a `kill -9`'d replica is replaced,
the target stays within [min_replicas, max_replicas], and `sluice status` prints the
escapes as text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time

import pytest
import redis
import redis.asyncio as aioredis

from controlplane import ops
from controlplane.records import ReplicaRecord
from controlplane.redisserver import EmbeddedRedis
from controlplane.servicespec import parse_spec
from controlplane.store import Store
from tests.controlplane.test_redis_access import (  # noqa: F401 (fixtures)
    CONTROLLER_PASSWORD,
    PROXY_PASSWORD,
    _user_url,
    acl_server,
    controller,
    redis7,
)
from tests.support.builders import RUN, pid_of
from tests.support.cli import sluice
from tests.support.poll import until
from tests.support.processes import REPO

ESCAPES = b"\x1b]0;pwned\x07\x1b[2J\x1b[Hllm  ok"


def _spec() -> dict[str, object]:
    return {
        "service": {
            "readiness_probe": {"path": "/health", "endpoint_probe_interval_seconds": 0.2,
                                "timeout_seconds": 2, "initial_delay_seconds": 20},
            "replica_policy": {"min_replicas": 1, "max_replicas": 2,
                               "target_qps_per_replica": 1000,
                               "upscale_delay_seconds": 1, "downscale_delay_seconds": 1},
        },
        "workdir": str(REPO),
        "run": RUN,
    }  # fmt: skip


async def _attack(as_proxy: aioredis.Redis) -> None:
    """What the proxy ACL user can write (each command allowed by its ACL)."""
    now = int(time.time())
    fresh = json.dumps({"at": now, "total": 1})
    await as_proxy.hset("sluice:svc:llm:inflight", b"\xff", fresh)
    await as_proxy.hset("sluice:svc:llm:inflight", "p:1", '{"at": 1, "total": ' + "9" * 401 + "}")
    with contextlib.suppress(redis.exceptions.NoPermissionError):  # the ACL is HINCRBY-only
        await as_proxy.hset("sluice:svc:llm:rps", str(now - 1), "9" * 401)
    # (ResponseError: int64 overflow, or a field an older ACL let be set to 401 digits.)
    for field, delta in ((str(now - 1), 2**63 - 1), (str(now - 2), -1066), (b"\xff\xfe", 1)):
        with contextlib.suppress(redis.exceptions.ResponseError):
            await as_proxy.hincrby("sluice:svc:llm:rps", field, delta)
    beat = json.dumps({"generation": 1, "seen_at": now, "applied_at": now, "connected": True})
    await as_proxy.hset("sluice:svc:llm:proxies", ESCAPES, beat)
    await as_proxy.hset("sluice:svc:llm:proxies", b"\xff", beat)
    await as_proxy.hset("sluice:svc:llm:proxies", "p:2", '{"generation": ' + "9" * 401 + "}")
    for nudge in (b"\xff\xfe", b'{"service": 5}', b'{"service": "llm", "reason": "demand"',
                  b"x" * 10_000, ESCAPES):
        await as_proxy.publish("sluice:control", nudge)


@pytest.mark.slow
async def test_a_hostile_proxy_user_cannot_stop_the_controller(
    acl_server: EmbeddedRedis,  # noqa: F811
    controller: asyncio.Task[None],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller_url = _user_url(acl_server, "sluice-controller", CONTROLLER_PASSWORD)
    as_proxy = aioredis.Redis.from_url(_user_url(acl_server, "sluice-proxy-llm", PROXY_PASSWORD))
    caplog.set_level(logging.WARNING)
    try:
        async with Store.from_url(controller_url) as store:
            await ops.up(store, "llm", parse_spec(_spec()))
            [first] = await _ready(store, 1)
            attacked_at = time.time()
            await _attack(as_proxy)

            # The autoscaler decides again (every 20 s) on what it read after the attack.
            async def decided() -> bool:
                await _attack(as_proxy)
                status = await store.telemetry.read_autoscaler("llm")
                return status is not None and status.at > attacked_at

            await until(decided, timeout=60, interval=0.5, what="an autoscaling decision")

            # The controller still reconciles: a kill -9'd replica leaves the snapshot
            # and is replaced, with the hostile values rewritten meanwhile.
            os.kill(pid_of(first), signal.SIGKILL)

            async def replaced() -> bool:
                await _attack(as_proxy)
                state = await store.read_state("llm")
                assert state is not None
                ready = [r for r in state.replicas.values() if r.status.value == "READY"]
                return [r.id for r in ready] not in ([], [first.id])

            await until(replaced, timeout=60, interval=0.5, what="a replacement replica")
            snapshot = await store.snapshot("llm")
            assert snapshot is not None and first.id not in [r.id for r in snapshot.replicas]
            decision = await store.telemetry.read_autoscaler("llm")
            assert decision is not None and 1 <= decision.target <= 2, decision
            assert decision.qps is not None and 0 <= decision.qps < 10
        assert not controller.done()
        text = caplog.text
        assert "reconcile failed" not in text and "reconcile step failed" not in text, text
        assert "Traceback" not in text
        # Logged, but once per kind (a minute's rate limit), not once per step.
        skipped = [r for r in caplog.records if "invalid rps value" in r.getMessage()]
        assert 1 <= len(skipped) <= 2, [r.getMessage() for r in skipped]

        # `sluice status` (as the ops commands' user) works and prints escapes as text.
        result = await asyncio.to_thread(
            sluice, "status", "llm", env={"SLUICE_REDIS_URL": controller_url})
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output
        assert "Traceback" not in result.output
    finally:
        await as_proxy.aclose()


async def _ready(store: Store, n: int) -> list[ReplicaRecord]:
    await ops.wait_for(store, "llm", lambda v: v.ready >= n, timeout=60)
    state = await store.read_state("llm")
    assert state is not None
    return [r for r in state.replicas.values() if r.status.value == "READY"]

