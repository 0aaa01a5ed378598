"""`sluice dashboard`'s server and poller against a real redis-server: read-only (405 on
every write method, nothing written to Redis), pages served from memory (N streams cost
Redis what none do), the token and the Host check, TLS, the engine dict present or
absent, a bounded ring buffer, Redis going away. The page itself: test_dashboard_browser.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controlplane.dashboard import DashboardConfig, DashboardConfigError, server
from controlplane.dashboard.model import engine_scalars, rollout
from controlplane.dashboard.poller import Poller
from controlplane.dashboard.server import make_app
from controlplane.ops import ReplicaStatusView, ServiceView
from controlplane.states import ReplicaStatus
from controlplane.store import Store, StoreUnavailable
from controlplane.store.telemetry import Telemetry
from tests.support.builders import make_spec, registered, replica
from tests.support.cancel import SwallowsCancel
from tests.support.cli import one_line_error, sluice
from tests.support.poll import until
from tests.support.ports import HOST, free_port
from tests.support.tls import write_cert

Serve = Callable[..., Awaitable[tuple[Poller, str]]]
WRITES = ("POST", "PUT", "PATCH", "DELETE", "OPTIONS")
PATHS = ("/", "/service/svc", "/api/fleet", "/api/services/svc", "/api/stream",
         "/static/app.js", "/healthz", "/nowhere")  # fmt: skip


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """`await serve(store, **config)`: the dashboard app on a free port, its poller not
    looping (the test steps it); (poller, base URL). Closed at teardown."""
    runners: list[web.AppRunner] = []

    async def start(store: Store, ssl_context: ssl.SSLContext | None = None,
                    history: int = 600, **fields: Any) -> tuple[Poller, str]:  # fmt: skip
        config = DashboardConfig(host=HOST, port=free_port(), **fields)
        poller = Poller(store, history=history)
        runner = web.AppRunner(make_app(poller, config), access_log=None, shutdown_timeout=0.5)
        runners.append(runner)
        await runner.setup()
        await web.TCPSite(runner, HOST, config.port, ssl_context=ssl_context).start()
        scheme = "https" if ssl_context else "http"
        return poller, f"{scheme}://{HOST}:{config.port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def _two_replicas(store: Store) -> None:
    await registered(store, "svc", spec=make_spec(2).to_json())
    await store.commit("svc", replica_updates=[replica(1), replica(2, version=1)])


async def _commands(client: aioredis.Redis) -> int:
    info = await client.info("stats")
    return int(info["total_commands_processed"])


async def _keys(client: aioredis.Redis, prefix: str) -> dict[bytes, Any]:
    """Every key under the prefix with a dump of its value (to see that nothing moved)."""
    out = {}
    async for key in client.scan_iter(match=f"{prefix}:*"):
        out[key] = await client.dump(key)
    return out


async def test_every_write_method_is_refused_and_nothing_is_written(
    store: Store, serve: Serve, http: aiohttp.ClientSession, redis_client: aioredis.Redis,
    redis_prefix: str,
) -> None:  # fmt: skip
    await _two_replicas(store)
    poller, base = await serve(store)
    await poller.step()
    before = await _keys(redis_client, redis_prefix)
    for method in WRITES:
        for path in PATHS:
            async with http.request(method, base + path, data=b'{"status": "FAILED"}') as resp:
                assert resp.status == 405, (method, path, resp.status)
                assert resp.headers["Allow"] == "GET, HEAD"
                assert "read-only" in (await resp.json())["error"]
    async with http.get(base + "/api/services/svc") as resp:
        assert resp.status == 200
        assert [r["status"] for r in (await resp.json())["replicas"]] == ["READY", "READY"]
    async with http.head(base + "/api/fleet") as resp:
        assert resp.status == 200
    assert await _keys(redis_client, redis_prefix) == before


async def test_pages_and_streams_cost_redis_nothing_beyond_the_one_poll(
    store: Store, serve: Serve, http: aiohttp.ClientSession, redis_client: aioredis.Redis,
) -> None:  # fmt: skip
    await _two_replicas(store)
    poller, base = await serve(store)
    await poller.step()
    start = await _commands(redis_client)
    await poller.step()
    one_step = await _commands(redis_client) - start - 1  # the INFO itself counts once
    assert one_step > 0

    streams = [await http.get(f"{base}/api/stream?service=svc") for _ in range(3)]
    streams.append(await http.get(f"{base}/api/stream"))
    try:
        quiet = await _commands(redis_client)
        for _ in range(10):
            for path in ("/", "/api/fleet", "/api/services/svc", "/static/app.js"):
                async with http.get(base + path) as resp:
                    assert resp.status == 200, path
        assert await _commands(redis_client) == quiet + 1  # only the INFO: pages read memory

        before = await _commands(redis_client)
        await poller.step()
        with_streams = await _commands(redis_client) - before - 1
        assert with_streams == one_step  # four open streams: the same one poll
        for resp in streams:  # ... and every stream got that poll's data
            line = await asyncio.wait_for(resp.content.readline(), 5)
            assert line.startswith(b"data: {"), line
    finally:
        for resp in streams:
            resp.close()


async def test_token_is_required_and_traded_for_a_strict_cookie(
    store: Store, serve: Serve,
) -> None:  # fmt: skip
    token = "t0ken-0123456789abcdef"
    await _two_replicas(store)
    poller, base = await serve(store, token=token)
    await poller.step()
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                        {"Authorization": token}):  # fmt: skip
            async with http.get(base + "/api/fleet", headers=headers) as resp:
                assert resp.status == 401, headers
        async with http.get(base + "/api/fleet?token=nope") as resp:
            assert resp.status == 401
        async with http.get(base + "/api/fleet",
                            headers={"Authorization": f"Bearer {token}"}) as resp:  # fmt: skip
            assert resp.status == 200
        async with http.get(f"{base}/service/svc?token={token}&x=1",
                            allow_redirects=False) as resp:  # fmt: skip
            assert resp.status == 303
            assert resp.headers["Location"] == "/service/svc?x=1"
            cookie = resp.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
        async with http.get(f"{base}//evil.example/?token={token}",
                            allow_redirects=False) as resp:  # fmt: skip
            assert resp.headers["Location"] == "/evil.example/"  # never another host
        async with http.get(base + "/api/services/svc") as resp:  # the cookie now
            assert resp.status == 200
        async with http.post(base + "/api/fleet") as resp:  # a token does not allow writes
            assert resp.status == 405


async def test_loopback_dashboard_refuses_a_foreign_host_header(
    store: Store, serve: Serve, http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """A DNS-rebinding page (its own name resolving to 127.0.0.1) cannot read it."""
    await _two_replicas(store)
    poller, base = await serve(store)
    await poller.step()
    async with http.get(base + "/api/fleet", headers={"Host": "evil.example:80"}) as resp:
        assert resp.status == 421
    for host in ("evil.example", "[::1].evil.example", "127.0.0.1.evil.example:80"):
        async with http.get(base + "/api/fleet", headers={"Host": host}) as resp:
            assert resp.status == 421, host
    for host in ("localhost", "LOCALHOST:8090", "127.0.0.1:1234", "[::1]:80", "[::1]"):
        async with http.get(base + "/api/fleet", headers={"Host": host}) as resp:
            assert resp.status == 200, host


async def test_security_headers_on_every_response(
    store: Store, serve: Serve, http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    poller, base = await serve(store)
    await poller.step()
    for path in ("/", "/api/fleet", "/static/app.js", "/api/services/none", "/nowhere"):
        async with http.get(base + path) as resp:
            csp = resp.headers["Content-Security-Policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp, path
            assert "unsafe-inline" not in csp
            assert resp.headers["X-Content-Type-Options"] == "nosniff"


async def test_tls(store: Store, serve: Serve, tmp_path: Path) -> None:
    ca, certfile, keyfile = write_cert(tmp_path)
    config = DashboardConfig(host="10.1.2.3", tls_certfile=str(certfile), tls_keyfile=str(keyfile))
    assert config.check() == ["no --token: anyone who reaches the port can read the fleet"]
    server_ssl = config.ssl_context()
    assert server_ssl is not None
    poller, base = await serve(store, ssl_context=server_ssl)
    await poller.step()
    client_ssl = ssl.create_default_context()
    ca.configure_trust(client_ssl)
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/api/fleet", ssl=client_ssl) as resp:
            assert resp.status == 200
            assert (await resp.json())["services"] == []
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await http.get(base + "/api/fleet")  # not trusted without the CA


def test_config_refuses_what_is_unsafe() -> None:
    with pytest.raises(DashboardConfigError, match="--token"):
        DashboardConfig(host="0.0.0.0").check()
    with pytest.raises(DashboardConfigError, match="16 characters"):
        DashboardConfig(token="short").check()
    with pytest.raises(DashboardConfigError, match="go together"):
        DashboardConfig(tls_certfile="cert.pem").check()
    assert DashboardConfig().check() == []
    assert DashboardConfig(host="::1").check() == []
    assert DashboardConfig(host="0.0.0.0", token="x" * 16).check() == [
        "no TLS: the token crosses the network in clear text"
    ]


def test_cli_refuses_a_public_host_without_token_or_tls() -> None:
    """Refused before anything listens or connects (one line, exit 1)."""
    result = sluice("dashboard", "--host", "0.0.0.0", "--redis", "redis://127.0.0.1:1/0",
                    env={"SLUICE_DASHBOARD_TOKEN": ""})  # fmt: skip
    one_line_error(result, "--host 0.0.0.0 is not loopback", "--token")


class RawView(msgspec.Struct, frozen=True):
    """A view as `read_engines` answers it (`.replicas`), with entries of any shape."""

    replicas: dict[Any, Any]


class EngineTelemetry(Telemetry):
    """Engine views with entries of any shape (the real read drops what does not parse)."""

    async def read_engines(self, name: str) -> RawView:  # type: ignore[override]
        return RawView({
            1: {"waiting": 3, "running": 2, "kv_usage": 0.5, "nested": {"x": 1},
                "bad": math.nan, "text": "<b>" + "y" * 200},
            "not-an-id": {"waiting": 1},
            2: "not a mapping",
        })  # fmt: skip


async def test_engine_dict_shown_when_the_store_has_one_and_absent_otherwise(
    redis_client: aioredis.Redis, redis_prefix: str, store: Store,
) -> None:  # fmt: skip
    await _two_replicas(store)
    plain = Poller(store)
    await plain.step()
    doc = plain.service_body("svc")
    assert b'"engine"' not in doc
    engine_store = Store(redis_client, prefix=redis_prefix)
    engine_store.telemetry = EngineTelemetry(redis_client, engine_store.keys, time.time,
                                             engine_store.rejects)  # fmt: skip
    with_engines = Poller(engine_store)
    await with_engines.step()
    replicas = msgspec.json.decode(with_engines.service_body("svc"))["replicas"]
    engine = replicas[0]["engine"]
    assert engine == {"waiting": 3, "running": 2, "kv_usage": 0.5, "text": "<b>" + "y" * 77}
    assert "engine" not in replicas[1]


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    """Shaped like the routing branch's EngineStats (proxy/wire/engines.py there)."""

    url: str = ""
    engine: str = "unknown"
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    ttft_p50: float | None = None


class View(msgspec.Struct, frozen=True, kw_only=True):
    """Shaped like its EngineView: replica id (a string) -> stats."""

    service: str = ""
    replicas: dict[str, Stats] = {}


class ViewTelemetry(Telemetry):
    """`read_engines` answers `view`, or None (nothing published)."""

    view: View | None = None

    async def read_engines(self, name: str) -> View | None:  # type: ignore[override]
        return self.view


async def test_engine_view_struct_with_unknown_fields_absent(
    redis_client: aioredis.Redis, redis_prefix: str, store: Store,
) -> None:  # fmt: skip
    await _two_replicas(store)
    view_store = Store(redis_client, prefix=redis_prefix)
    views = ViewTelemetry(redis_client, view_store.keys, time.time, view_store.rejects)
    view_store.telemetry = views
    poller = Poller(view_store)
    await poller.step()  # None: no engine anywhere
    assert b'"engine"' not in (poller.service_body("svc") or b"")
    views.view = View(service="svc", replicas={
        "2": Stats(url="http://127.0.0.1:20002", engine="llamacpp", running=1.0, waiting=0.0)})
    await poller.step()
    replicas = msgspec.json.decode(poller.service_body("svc") or b"")["replicas"]
    assert "engine" not in replicas[0]
    assert replicas[1]["engine"] == {"url": "http://127.0.0.1:20002", "engine": "llamacpp",
                                     "running": 1.0, "waiting": 0.0}  # None fields absent
    # A plain HTTP app (an echo server) is scraped too: no engine named, nothing measured.
    views.view = View(service="svc", replicas={
        "1": Stats(url="http://127.0.0.1:20001"), "2": Stats(url="http://127.0.0.1:20002")})
    await poller.step()
    replicas = msgspec.json.decode(poller.service_body("svc") or b"")["replicas"]
    assert all("engine" not in r for r in replicas)  # so the page has no Engine column


def test_engine_scalars_bounds_what_it_keeps() -> None:
    many = {f"k{i}": i for i in range(100)}
    assert len(engine_scalars(many)) == 24
    assert engine_scalars([1, 2]) == {}
    assert engine_scalars({"inf": math.inf, "ok": True}) == {"ok": True}


async def test_history_is_a_bounded_ring(store: Store) -> None:
    await _two_replicas(store)
    poller = Poller(store, history=5)
    for _ in range(8):
        await poller.step()
    assert len(poller.history["svc"]) == 5
    assert poller.seq == 8
    doc = msgspec.json.decode(poller.service_body("svc"))
    assert len(doc["history"]) == 5
    assert doc["history"][-1]["states"] == {"READY": 2}


async def test_redis_down_keeps_the_last_data_marked_with_the_error(
    redis_factory: Callable[..., Any],
) -> None:
    server = redis_factory()
    async with Store.from_url(server.url, socket_timeout=1.0) as store:
        await _two_replicas(store)
        poller = Poller(store)
        await poller.step()
        server.stop()
        await poller.step()
        assert poller.error
        fleet = msgspec.json.decode(poller.fleet)
        assert fleet["error"] == poller.error
        assert [s["name"] for s in fleet["services"]] == ["svc"]
        assert poller.service_body("svc") is not None  # the service page keeps its last document


async def test_wait_wakes_on_the_next_step(store: Store) -> None:
    poller = Poller(store, interval=0.05)
    await poller.start()
    try:
        seq = poller.seq
        assert await poller.wait(seq, 5) > seq
        await until(lambda: poller.seq >= seq + 3, timeout=5, what="three more steps")
    finally:
        await poller.aclose()
    assert await poller.wait(poller.seq, 0.01) == poller.seq  # a timeout returns the same


def _view(*replicas: tuple[int, int, str], version: int, active: list[int]) -> ServiceView:
    return ServiceView(
        name="svc", status="READY", version=version, active_versions=active,
        update_mode="rolling", policy="least_load", endpoint=None, created_at=0.0, uptime=0.0,
        ready=0, total=0, generation=1, target=2,
        replicas=[ReplicaStatusView(id=i, version=v, url=None, status=s, backend="local",
                              launched_at=None, first_ready_at=None) for i, v, s in replicas],
    )  # fmt: skip


def test_rollout_progress() -> None:
    ready, starting = ReplicaStatus.READY.value, ReplicaStatus.STARTING.value
    mid = rollout(_view((1, 1, ready), (2, 1, ready), (3, 2, ready), (4, 2, starting),
                        version=2, active=[1, 2]))  # fmt: skip
    assert mid == {"version": 2, "old_versions": [1], "new_ready": 1, "new_total": 2,
                   "old_ready": 2, "old_total": 2, "target": 2,
                   "active_versions": [1, 2]}  # fmt: skip
    # Old replicas gone (failed or shutting down do not count): done.
    done = _view((1, 1, ReplicaStatus.SHUTTING_DOWN.value), (3, 2, ready), (4, 2, ready),
                 version=2, active=[2])  # fmt: skip
    assert rollout(done) is None
    assert rollout(_view((3, 2, ready), version=2, active=[1, 2])) is not None


async def test_events_are_joined_across_steps_and_reread_after_a_burst(store: Store) -> None:
    """Each step reads only the newest few events once it holds the latest ones; a burst
    larger than that read is read whole again, so the timeline never has a hole."""
    await _two_replicas(store)
    for i in range(120):
        await store.append_event("svc", "launch", {"replica": 1, "n": i})
    poller = Poller(store)

    async def shown() -> list[str]:
        await poller.step()
        return [e["fields"].get("n", "") for e in
                msgspec.json.decode(poller.service_body("svc"))["events"]]  # fmt: skip

    assert await shown() == [str(i) for i in range(20, 120)]
    for i in range(120, 123):  # fewer than one peek: joined
        await store.append_event("svc", "launch", {"replica": 1, "n": i})
    assert await shown() == [str(i) for i in range(23, 123)]
    for i in range(123, 160):  # a burst: read whole again
        await store.append_event("svc", "launch", {"replica": 1, "n": i})
    assert await shown() == [str(i) for i in range(60, 160)]
    assert await shown() == [str(i) for i in range(60, 160)]  # nothing new: the same


async def test_request_rate_reads_only_the_last_seconds(
    store: Store, redis_client: aioredis.Redis,
) -> None:  # fmt: skip
    await _two_replicas(store)
    key = store.keys.rps("svc")
    await redis_client.hset(key, mapping={"100": 7, "101": "x", "102": 9, "5": 1})
    assert await store.telemetry.read_rps_seconds("svc", range(100, 104)) == {100: 7, 102: 9}
    assert await store.telemetry.read_rps_seconds("svc", []) == {}
    now = 1_000_000.0
    await redis_client.hset(key, mapping={str(int(now) - 2): 42, str(int(now) - 1): 3})
    poller = Poller(store, clock=lambda: now)
    await poller.step()
    fleet = msgspec.json.decode(poller.fleet)
    assert fleet["services"][0]["rps"] == 42  # the newest whole second
    assert list(poller.history["svc"])[-1]["rps"] == 42


def test_cli_says_in_one_line_when_the_port_is_taken(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = sluice("dashboard", "--port", str(port), "--redis", redis_url)
    one_line_error(result, f"cannot listen on 127.0.0.1:{port}")


async def test_open_streams_are_bounded(
    store: Store, serve: Serve, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(server, "MAX_STREAMS", 2)
    poller, base = await serve(store)
    await poller.step()
    streams = [await http.get(f"{base}/api/stream") for _ in range(2)]
    try:
        async with http.get(f"{base}/api/stream") as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "5"
        streams.pop().close()

        async def slot() -> bool:  # the server sees a page gone at its next write
            await poller.step()
            return await _stream_ok(http, base)

        await until(slot, timeout=10, what="a stream slot again")
    finally:
        for resp in streams:
            resp.close()


async def _stream_ok(http: aiohttp.ClientSession, base: str) -> bool:
    resp = await http.get(f"{base}/api/stream")
    resp.close()
    return resp.status == 200


async def test_a_spec_that_does_not_decode_is_the_error_not_a_crash(store: Store) -> None:
    await _two_replicas(store)
    poller = Poller(store)
    await poller.step()
    await registered(store, "broken", spec=b'{"replicas": 2}')  # not a service spec
    await poller.step()
    assert poller.error is not None and "stored spec" in poller.error
    fleet = msgspec.json.decode(poller.fleet)
    assert fleet["error"] == poller.error
    assert [s["name"] for s in fleet["services"]] == ["svc"]  # the last good read
    assert poller.seq == 2  # the step completed: streams were woken with the error


# -- errors/s and routing reasons from the proxies' heartbeat counters ------------------------


def _beat(at: float, *, ok: int = 0, five: int = 0, cuts: int = 0,
          routed: dict[str, Any] | None = None, responses: dict[str, Any] | None = None,
          ) -> dict[str, Any]:  # fmt: skip
    return {"generation": 1, "seen_at": at, "connected": True,
            "responses": responses if responses is not None else {
                "2xx": ok, "3xx": 0, "4xx": 0, "5xx": five},
            "cuts": cuts, "routed": routed or {}}  # fmt: skip


async def test_errors_and_routing_reasons_are_rates_of_the_heartbeat_counters(
    store: Store, redis_client: aioredis.Redis,
) -> None:  # fmt: skip
    """Two proxies' heartbeats, as their Redis user writes them: the fleet row's errors/s
    and the chart sample's routing reasons are the sums of their rates; a proxy that
    restarted (counters went down) counts from 0, a hostile one is clamped or skipped."""
    await _two_replicas(store)
    key = store.keys.proxies("svc")
    t = time.time()
    clock = [t]
    poller = Poller(store, clock=lambda: clock[0])

    async def beats(**entries: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if entries:
            await redis_client.hset(key, mapping={
                k: msgspec.json.encode(v) for k, v in entries.items()})
        await poller.step()
        fleet = msgspec.json.decode(poller.fleet)["services"][0]
        return fleet, list(poller.history["svc"])[-1]

    fleet, point = await beats(a=_beat(t, ok=100, five=1, routed={"affinity": 10, "spill": 0}))
    assert fleet["errors_per_s"] is None or fleet["errors_per_s"] == 0  # a first beat: no rate
    clock[0] = t + 2
    fleet, point = await beats(
        a=_beat(t + 2, ok=200, five=5, cuts=2, routed={"affinity": 30, "spill": 4}),
        b=_beat(t + 2, ok=0))
    assert fleet["errors_per_s"] == 3.0  # (4 more 5xx + 2 cuts) / 2 s
    assert point["errors"] == 3.0
    assert point["routed"] == {"affinity": 10.0, "spill": 2.0}
    # The same heartbeats again (the poller ticked between two proxy writes): same rates.
    clock[0] = t + 2.5
    fleet, point = await beats()
    assert fleet["errors_per_s"] == 3.0 and point["routed"] == {"affinity": 10.0, "spill": 2.0}
    # `a` restarted (its counters start again); `b` is hostile: negative, huge, many keys.
    clock[0] = t + 3
    fleet, point = await beats(
        a=_beat(t + 3, ok=1, five=1, routed={"affinity": 2}),
        b=_beat(t + 3, responses={"2xx": -5, "5xx": 2**70}, cuts=-1,
                routed={f"r{i}": 1 for i in range(50)}))
    assert fleet["errors_per_s"] is not None and math.isfinite(fleet["errors_per_s"])
    assert fleet["errors_per_s"] <= 1e7 + 1  # clamped
    assert point["routed"]["affinity"] == 2.0  # from 0 after the restart, not negative
    assert len(point["routed"]) <= 1 + 8
    # Every proxy gone quiet: n/a, not a stale rate.
    clock[0] = t + 30
    fleet, point = await beats()
    assert fleet["errors_per_s"] is None and point["routed"] is None


def test_rate_tracker_skips_what_is_not_a_count() -> None:
    from controlplane.dashboard.rates import RateTracker
    from proxy.wire.telemetry import ProxyHeartbeat

    tracker = RateTracker()

    def beat(at: float, five: Any, reason: Any) -> ProxyHeartbeat:
        return ProxyHeartbeat(seen_at=at, responses={"2xx": 0, "5xx": five},
                              routed={"affinity": reason, "": 5, "x" * 40: 5})  # type: ignore[dict-item]

    tracker.update("s", {"p": beat(0.0, 0, 0)}, 0.0)
    rates = tracker.update("s", {"p": beat(1.0, math.nan, math.inf)}, 1.0)
    assert rates.errors_per_s == 0.0  # NaN 5xx skipped
    assert not rates.routed  # inf skipped; empty and overlong names ignored
    # An older proxy (no counters at all): n/a.
    assert tracker.update("old", {"p": ProxyHeartbeat(seen_at=1.0)}, 1.0).errors_per_s is None


async def test_the_poller_stops_when_a_library_under_its_step_swallows_the_cancel(
    store: Store,
) -> None:
    # redis-py turns a cancellation that lands in a command into a ConnectionError now
    # and then: the poller took it for a failed poll and went on, and `aclose()` (one
    # cancel, then an await) waited for ever.
    poller = Poller(store)
    step = SwallowsCancel(StoreUnavailable("connection closed while reading"))
    poller.step = step  # type: ignore[method-assign]
    await poller.start()
    await asyncio.wait_for(step.entered.wait(), 10)
    closing = asyncio.ensure_future(poller.aclose())
    done, _ = await asyncio.wait({closing}, timeout=10)
    assert closing in done, f"aclose() still waits after {step.calls} steps"
    assert step.calls == 1
