"""Drain until idle (controlplane/reconcile/drain.py): the rule on its own, then with a
real controller, real replicas, a real sluice-proxy and real Redis.

The reports of a dead or stuck proxy are what such a proxy leaves in Redis: the test
writes them there with the same structs a proxy writes (no fake proxy process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis

from controlplane import display, ops
from controlplane.reconcile import ControllerConfig
from controlplane.reconcile.drain import (
    HOLD_SECONDS,
    STALE_SECONDS,
    DrainReports,
    DrainWatch,
    proxy_holds,
)
from controlplane.run.config import RunConfig
from controlplane.servicespec import parse_spec
from controlplane.store import Store
from proxy.wire.telemetry import InflightEntry, ProxyHeartbeat
from tests.support.builders import make_spec, pid_of, ready_view
from tests.support.controllers import proxy_for
from tests.support.fakes import StartController, controller_config
from tests.support.pids import running
from tests.support.poll import until
from tests.support.processes import ProxyFactory

URL = "http://127.0.0.1:9"
ENCODER = msgspec.json.Encoder()


def beat(generation: int, applied_at: float, *recent: tuple[int, float]) -> ProxyHeartbeat:
    return ProxyHeartbeat(generation=generation, applied_at=applied_at, seen_at=applied_at,
                          recent=list(recent))  # fmt: skip


def entry(at: float, n: int = 0) -> InflightEntry:
    replicas = {URL: n} if n else {}
    return InflightEntry(at=at, total=sum(replicas.values()), replicas=replicas)


# -- the rule ---------------------------------------------------------------------------------


def test_a_proxy_is_clear_only_after_it_applied_the_set_without_the_replica() -> None:
    # Still on generation 4 (the replica left at 5): it may route new requests there.
    assert proxy_holds(URL, 5, beat(4, 10.0), entry(11.0)) == (True, 0)
    # Applied 5 at t=10 but counted at t=9.5: the count predates the apply.
    assert proxy_holds(URL, 5, beat(6, 12.0, (5, 10.0), (6, 12.0)), entry(9.5)) == (True, 0)
    # Counted after the first apply of >= 5 (even if a later one came since): clear.
    assert proxy_holds(URL, 5, beat(6, 12.0, (5, 10.0), (6, 12.0)), entry(10.5)) == (False, 0)
    # Requests still on it.
    assert proxy_holds(URL, 5, beat(5, 10.0), entry(11.0, n=2)) == (True, 2)
    # No heartbeat, or no in-flight entry: nothing vouches for it.
    assert proxy_holds(URL, 5, None, entry(11.0)) == (True, 0)
    assert proxy_holds(URL, 5, beat(5, 10.0), None) == (True, 0)
    # A hostile negative count neither holds nor subtracts.
    assert proxy_holds(URL, 5, beat(5, 10.0), entry(11.0, n=-3)) == (False, 0)


def test_a_proxy_that_joined_after_the_replica_left_holds_nothing() -> None:
    # Its first apply was generation 7; it never had the replica (left at 5).
    assert proxy_holds(URL, 5, beat(7, 50.0, (7, 50.0)), entry(50.5)) == (False, 0)


def looked(watch: DrainWatch, reports: DrainReports, since: float, until: float) -> set[str]:
    """The live set at `until`, the controller having looked every 0.5 s from `since`
    (a draining replica is looked at that often)."""
    t = since
    live = watch.live("svc", reports, now=t)
    while t < until:
        t = min(until, t + 0.5)
        live = watch.live("svc", reports, now=t)
    return live


def test_a_report_that_stops_changing_stops_counting() -> None:
    watch = DrainWatch()
    reports = DrainReports(5, {"p": beat(4, 1.0)}, {"p": entry(1.0, n=1)})
    assert watch.live("svc", reports, now=100.0) == {"p"}  # first seen: live
    assert looked(watch, reports, 100.0, 100.0 + STALE_SECONDS) == {"p"}
    assert looked(watch, reports, 100.0 + STALE_SECONDS, 100.1 + STALE_SECONDS) == set()
    fresh = DrainReports(5, {"p": beat(4, 2.0)}, {"p": entry(2.0, n=1)})
    assert looked(watch, fresh, 105.5, 106.0) == {"p"}  # changed again: live
    # A proxy whose clock is far off (its times in the future) is judged by change too.
    skewed = DrainReports(5, {"q": beat(5, 1e12)}, {"q": entry(1e12, n=1)})
    assert looked(watch, skewed, 106.5, 107.0) == {"q"}
    assert looked(watch, skewed, 107.0, 107.1 + STALE_SECONDS) == set()


def test_a_stale_proxy_holds_what_its_last_report_had_in_flight_for_the_hold() -> None:
    # A live proxy whose flushes stopped (its process runnable, not run, for 7.5 s on a
    # busy 2-core VM) with a stream on the draining replica: stopping the replica after
    # STALE_SECONDS cut the stream.
    watch = DrainWatch()
    streaming = DrainReports(5, {"p": beat(5, 10.0, (5, 10.0))}, {"p": entry(11.0, n=1)})
    live = looked(watch, streaming, 100.0, 101.0 + STALE_SECONDS)
    assert live == set()  # stale...
    verdict = watch.verdict("svc", 1, URL, streaming, live)
    assert not verdict.idle and verdict.holders == ("p",) and verdict.inflight == 1
    live = looked(watch, streaming, 101.0 + STALE_SECONDS, 100.0 + HOLD_SECONDS)
    assert not watch.verdict("svc", 1, URL, streaming, live).idle  # ...but holding
    # Past the hold it holds nothing: a dead proxy costs a drain HOLD_SECONDS, no more.
    live = looked(watch, streaming, 100.0 + HOLD_SECONDS, 100.5 + HOLD_SECONDS)
    assert watch.verdict("svc", 1, URL, streaming, live).idle

    # A stale report with nothing on the replica holds nothing once stale, even from an
    # older generation (a request it sends there later fails to connect, and is retried).
    clear = DrainReports(5, {"q": beat(4, 1.0)}, {"q": entry(1.0)})
    other = DrainWatch()
    assert not other.verdict("svc", 1, URL, clear, looked(other, clear, 100.0, 101.0)).idle
    live = looked(other, clear, 101.0, 100.5 + STALE_SECONDS)
    assert live == set() and other.verdict("svc", 1, URL, clear, live).idle


def test_a_controller_that_could_not_look_sees_every_report_fresh() -> None:
    # Redis down (or the controller stalled) for longer than STALE_SECONDS: no report
    # could be seen changing, so none is judged stale on the first look after; it goes
    # stale once it has been looked at, unchanged, for STALE_SECONDS.
    watch = DrainWatch()
    reports = DrainReports(5, {"p": beat(5, 10.0, (5, 10.0))}, {"p": entry(11.0, n=1)})
    assert looked(watch, reports, 100.0, 101.0) == {"p"}
    assert watch.live("svc", reports, now=101.0 + HOLD_SECONDS) == {"p"}  # after a gap
    start = 101.0 + HOLD_SECONDS
    assert looked(watch, reports, start, start + STALE_SECONDS) == {"p"}
    assert looked(watch, reports, start + STALE_SECONDS, start + STALE_SECONDS + 0.5) == set()


def test_the_generation_a_replica_left_at_is_the_lowest_seen() -> None:
    watch = DrainWatch()
    p = {"p": beat(6, 20.0, (5, 10.0), (6, 20.0))}
    e = {"p": entry(15.0)}  # counted after applying 5, before applying 6
    assert watch.verdict("svc", 1, URL, DrainReports(5, p, e), {"p"}).idle
    # A later read sees generation 6 in Redis: the replica still left at 5.
    assert watch.verdict("svc", 1, URL, DrainReports(6, p, e), {"p"}).idle
    # Another replica first seen draining at 6 needs a count after 6's apply.
    assert not watch.verdict("svc", 2, URL, DrainReports(6, p, e), {"p"}).idle


def test_sluice_run_and_the_controller_share_the_120s_bound() -> None:
    # No 5 s default under `sluice run` that cuts streams.
    assert RunConfig.drain_seconds == ControllerConfig.drain_seconds == 120.0


def test_status_shows_a_draining_replica_with_its_in_flight_count() -> None:
    view = ops.ServiceView(name="svc", status="READY", version=2, active_versions=[2],
                           update_mode="rolling", policy="least_load", endpoint=None,
                           created_at=0.0, uptime=1.0, ready=1, total=1, generation=3,
                           replicas=[
        ops.ReplicaStatusView(id=1, version=2, url="http://h:1", status="READY", backend="local",
                        launched_at=0.0, first_ready_at=0.0),
        ops.ReplicaStatusView(id=2, version=1, url="http://h:2", status="SHUTTING_DOWN",
                        backend="local", launched_at=0.0, first_ready_at=0.0,
                        draining_since=0.5, inflight=3),
    ])  # fmt: skip
    text = display.replicas_table([view], now=1.0)
    assert "SHUTTING_DOWN (draining 3 in flight)" in text
    assert text.count("draining") == 1


# -- with real processes ----------------------------------------------------------------------

@pytest.fixture
def config(redis_url: str, redis_prefix: str, tmp_path: Path) -> ControllerConfig:
    # drain_seconds far beyond every wait below: only "idle" ends these drains.
    return controller_config(redis_url, redis_prefix, tmp_path, drain_seconds=90.0)


async def drain_events(store: Store, name: str) -> list[dict[str, str]]:
    return [e.fields for e in await store.events(name, count=1000) if e.kind == "drain"
            and e.fields.get("reason") in ("idle", "max_drain")]  # fmt: skip


async def write_report(
    client: aioredis.Redis, store: Store, name: str, proxy_id: str, *,
    generation: int, at: float, url: str, inflight: int,
) -> None:  # fmt: skip
    """What a sluice-proxy's flush writes (its heartbeat and in-flight entry)."""
    heartbeat = ProxyHeartbeat(generation=generation, applied_at=at - 1, seen_at=at,
                               connected=True, recent=[(generation, at - 1)])  # fmt: skip
    counts = InflightEntry(at=at, total=inflight, replicas={url: inflight})
    await client.hset(store.keys.proxies(name), proxy_id, ENCODER.encode(heartbeat))
    await client.hset(store.keys.inflight(name), proxy_id, ENCODER.encode(counts))


async def replica_inflight(replica_url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{replica_url}/stats") as resp:
        n: int = (await resp.json())["in_flight"]
        return n


async def pids(store: Store, name: str) -> dict[int, int]:
    return {i: pid_of(r) for i, r in (await store.replicas(name)).items() if r.handle}


@pytest.mark.slow
@pytest.mark.parametrize("stall", [False, True], ids=["live", "stalled"])
async def test_a_long_stream_is_served_to_its_end_then_the_replica_stops_at_once(
    store: Store,
    redis_url: str,
    redis_prefix: str,
    start_controller: StartController,
    proxy_factory: ProxyFactory,
    stall: bool,
) -> None:
    """`stalled`: the real sluice-proxy is stopped (SIGSTOP) for longer than
    STALE_SECONDS while it relays the stream from the draining replica, so its reports
    stop changing (as when its process was not run for 7.5 s on a busy VM): the stream
    must still end whole."""
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    view = await ready_view(store, "svc", 2)
    replica_urls = [r.url or "" for r in view.replicas]
    before = await pids(store, "svc")
    proxy = await proxy_factory.astart(
        "--redis", redis_url, "--service", "svc", "--redis-prefix", redis_prefix,
        "--shutdown-grace", "1", wait="ready",
    )  # fmt: skip
    events, interval = 80, 0.25  # a 20 s stream on each replica

    async def stream(session: aiohttp.ClientSession) -> tuple[str, int]:
        async with session.get(f"{proxy.url}/sse?n={events}&interval={interval}") as resp:
            body = await resp.read()
            return resp.headers["X-Replica-Id"], body.count(b"data: ")

    async with aiohttp.ClientSession() as session:
        streams = [asyncio.create_task(stream(session)) for _ in range(2)]

        async def spread() -> bool:
            return [await replica_inflight(u) for u in replica_urls] == [1, 1]

        await until(spread, timeout=5, what="one stream on each replica")
        await ops.update(store, "svc", make_spec(1))
        # sluice status says which replica drains, and for how many requests.
        draining = await ops.wait_for(
            store, "svc", lambda v: any(r.inflight for r in v.replicas), 5
        )
        (leaving,) = [r for r in draining.replicas if r.inflight is not None]
        assert leaving.status == "SHUTTING_DOWN" and leaving.inflight == 1
        if stall:
            os.kill(proxy.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(STALE_SECONDS + 3)  # the stall under test, not a sync
                assert running(before[leaving.id])  # its last report had the stream there
            finally:
                os.kill(proxy.pid, signal.SIGCONT)
        # A proxy that joins while the replica drains never routed to it: it must not
        # hold the drain (its first report is already past the generation it left at).
        await proxy_for(proxy_factory, redis_url, redis_prefix, "svc")
        results = await asyncio.gather(*streams)

    # Both streams ran to their end, the one on the leaving replica included, though
    # a 20 s stream outlives the old fixed drain (5 s under sluice run).
    assert sorted(results) == [("1", events), ("2", events)]
    # Stopped once idle: long before the 90 s bound.
    await ready_view(store, "svc", 1, timeout=15)
    assert not running(before[leaving.id])
    (drained,) = await drain_events(store, "svc")
    assert drained["reason"] == "idle" and drained["replica"] == str(leaving.id)


async def test_a_dead_proxys_report_does_not_hold_a_drain(
    store: Store, redis_client: aioredis.Redis, start_controller: StartController
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    view = await ready_view(store, "svc", 2)
    before = await pids(store, "svc")
    # A proxy that died on an old generation (it might have routed to replica 2) with a
    # request on replica 1: its report stays in Redis and never changes again. (One that
    # died with a request on replica 2 holds it HOLD_SECONDS: test_a_stale_proxy_holds_...)
    url1 = next(r.url for r in view.replicas if r.id == 1) or ""
    await write_report(redis_client, store, "svc", "dead:1", generation=1, at=time.time(),
                       url=url1, inflight=1)  # fmt: skip
    await ops.update(store, "svc", make_spec(1))
    await ops.wait_for(store, "svc", lambda v: any(r.status == "SHUTTING_DOWN"
                                                   for r in v.replicas), 5)  # fmt: skip
    # Stopped once the report went stale (STALE_SECONDS), long before the 90 s bound.
    await ready_view(store, "svc", 1, timeout=STALE_SECONDS + 10)
    assert not running(before[2])
    (drained,) = await drain_events(store, "svc")
    assert drained["reason"] == "idle"


async def test_the_max_drain_bound_stops_a_held_replica_and_records_the_cut(
    store: Store, redis_client: aioredis.Redis, start_controller: StartController
) -> None:
    await start_controller()
    spec = make_spec(2)
    await ops.up(store, "svc", spec)
    view = await ready_view(store, "svc", 2)
    before = await pids(store, "svc")
    url2 = next(r.url for r in view.replicas if r.id == 2) or ""

    # A live proxy that keeps reporting a request on replica 2 (a stuck stream).
    async def stuck() -> None:
        while True:
            generation = await store.generation("svc")
            await write_report(redis_client, store, "svc", "stuck:1", generation=generation,
                               at=time.time(), url=url2, inflight=1)  # fmt: skip
            await asyncio.sleep(0.3)

    reporter = asyncio.create_task(stuck())
    try:
        # The service's own bound (service.sluice.max_drain_seconds) beats the 90 s.
        doc = {**msgspec.to_builtins(make_spec(1)), "service": {
            **msgspec.to_builtins(make_spec(1).service), "sluice": {"max_drain_seconds": 2.5}}}
        await ops.update(store, "svc", parse_spec(doc))
        await ready_view(store, "svc", 1, timeout=20)
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
    assert not running(before[2])
    (drained,) = await drain_events(store, "svc")
    assert drained["reason"] == "max_drain" and drained["cut"] == "1"
    assert drained["replica"] == "2"
