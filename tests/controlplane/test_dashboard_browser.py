"""The dashboard in a real headless Chromium (DevTools protocol, tests/support/browser.py)
against a real `sluice run` of three echo replicas and a real `sluice dashboard`:

- the replica rows (ids, states, versions) are those of `sluice status --json`;
- `sluice update` shows up live, in the same page (no reload): the rollout panel and
  the fleet row appear, the new version's rows take over;
- strings from Redis (a proxy id, an event's reason, a replica URL) are shown as text
  and never run;
- the page's console has no error (failed loads, CSP violations, exceptions included);
- screenshots, light and dark, of both pages during the rollout, into
  bench/results/dashboard/ (ignored by git; the path is printed).

Skips with one line when no chromium is installed (`.ci/run` installs Debian's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controlplane.dashboard import DashboardConfig
from controlplane.dashboard.poller import Poller
from controlplane.dashboard.server import make_app
from controlplane.store import Store
from controlplane.store.telemetry import Telemetry
from proxy.wire.telemetry import ProxyHeartbeat
from tests.support.browser import Chromium, Page, chromium_binary
from tests.support.builders import make_spec, registered, replica
from tests.support.cli import sluice, spawn_sluice, store_call
from tests.support.pids import descendants, kill_all
from tests.support.poll import until, until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, http_get

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_binary() is None,
                       reason="no chromium (Debian: apt-get install chromium)"),
]  # fmt: skip

SHOTS = REPO / "bench" / "results" / "dashboard"
SPEC = """\
name: echo
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 20
    endpoint_probe_interval_seconds: 0.5
  replicas: 3
workdir: {workdir}
envs:
  HOST: 127.0.0.1
  VARIANT: {variant}
run: sleep {delay}; exec python3 echo_server.py
"""
XSS = "<img src=x onerror=window.__xss=1>"


@dataclass
class Fleet:
    state: Path
    dashboard: str
    redis_url: str
    prefix: str
    tmp: Path

    def status(self) -> dict[str, Any]:
        result = sluice("status", "echo", "--json", "--state-dir", str(self.state))
        assert result.exit_code == 0, result.output
        views: list[dict[str, Any]] = json.loads(result.stdout)
        return views[0]

    def spec(self, variant: str) -> Path:
        path = self.tmp / f"echo-{variant}.yaml"
        # The new version loads for a few seconds (as a model server does), so the
        # rollout lasts long enough for a page that updates once a second to show it.
        path.write_text(SPEC.format(workdir=REPO / "examples", variant=variant, delay=4))
        return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """`sluice run` (embedded Redis, three replicas) and `sluice dashboard` on it."""
    tmp = tmp_path_factory.mktemp("dashboard")
    state = tmp / "state"
    env = {"SLUICE_REDIS_URL": None, "SLUICE_STATE_DIR": None, "SLUICE_DASHBOARD_TOKEN": None}
    spec = tmp / "echo-a.yaml"
    spec.write_text(SPEC.format(workdir=REPO / "examples", variant="a", delay=0))
    run = spawn_sluice(["run", str(spec), "--state-dir", str(state), "--host", HOST,
                        "--port", str(free_port()), "--drain-seconds", "0",
                        "--down-timeout", "20"], tmp / "run.log", env)  # fmt: skip
    started = {run.pid}
    dash = None
    try:
        def ready() -> bool:
            assert run.poll() is None, (tmp / "run.log").read_text()
            if not (state / "run.json").exists():
                return False
            result = sluice("status", "echo", "--json", "--state-dir", str(state))
            return result.exit_code == 0 and json.loads(result.stdout)[0]["ready"] == 3

        until_sync(ready, timeout=60, what="three READY echo replicas", interval=0.2)
        info = json.loads((state / "run.json").read_text())
        port = free_port()
        dash = spawn_sluice(["dashboard", "--state-dir", str(state), "--port", str(port)],
                            tmp / "dashboard.log", env)  # fmt: skip
        started.add(dash.pid)

        def serving() -> bool:
            assert dash is not None and dash.poll() is None, (tmp / "dashboard.log").read_text()
            with contextlib.suppress(OSError):
                return http_get(HOST, port, "/healthz")[0] == 200
            return False

        until_sync(serving, timeout=20, what="the dashboard to answer")
        password = Path(info["redis_password_file"]).read_text().strip()
        url = str(info["redis_url"]).replace("redis://", f"redis://:{password}@", 1)
        yield Fleet(state, f"http://{HOST}:{port}", url, info.get("prefix", "sluice"), tmp)
    finally:
        started.update(descendants(run.pid))
        if dash is not None and dash.poll() is None:
            dash.send_signal(signal.SIGTERM)
            dash.wait(10)
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            with contextlib.suppress(Exception):
                run.wait(30)
        kill_all(started)
        run.wait(10)
    assert "Traceback" not in (tmp / "dashboard.log").read_text()


ROWS_JS = """[...document.querySelectorAll('#replicas tbody tr[data-replica-id]')].map(tr => ({
  id: Number(tr.dataset.replicaId),
  status: tr.querySelector('[data-col=status] .badge').textContent,
  version: Number(tr.querySelector('[data-col=version]').textContent.slice(1)),
}))"""


def _rows(view: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": r["id"], "status": r["status"], "version": r["version"]}
            for r in view["replicas"]]  # fmt: skip


async def _matches_status(page: Page, fleet: Fleet, what: str) -> list[dict[str, Any]]:
    """Poll until the page's rows equal `sluice status --json`'s (read in the same poll)."""
    last: dict[str, Any] = {}

    async def same() -> bool:
        shown = await page.evaluate(ROWS_JS)
        last["page"], last["status"] = shown, _rows(await asyncio.to_thread(fleet.status))
        return bool(shown) and shown == last["status"]

    await until(same, timeout=30, what=what, interval=0.2)
    rows: list[dict[str, Any]] = last["page"]
    return rows


async def test_pages_match_status_and_follow_a_rollout_live(fleet: Fleet) -> None:
    started = time.monotonic()
    async with Chromium.launch(fleet.tmp) as browser:
        fleet_page = await browser.new_page()
        await fleet_page.goto(fleet.dashboard + "/")
        await fleet_page.wait_for(
            "document.querySelector('tr[data-service=echo] [data-col=ready]')?.textContent"
            " === '3/3'", what="the fleet row of echo, 3/3 ready")
        status = await asyncio.to_thread(fleet.status)
        assert await fleet_page.evaluate(
            "document.querySelector('tr[data-service=echo] [data-col=status]').textContent"
        ) == status["status"]
        # The real proxy's heartbeats carry its counters: errors/s is a number, not n/a.
        await fleet_page.wait_for(
            "/^[0-9.]+$/.test(document.querySelector('tr[data-service=echo] "
            "[data-col=errors]')?.textContent || '')", what="errors/s from the heartbeats")

        page = await browser.new_page()
        await page.goto(fleet.dashboard + "/service/echo")
        rows = await _matches_status(page, fleet, "the page's rows to match status --json")
        assert [r["status"] for r in rows] == ["READY"] * 3
        assert {r["version"] for r in rows} == {1}
        assert await page.evaluate("document.querySelector('#rollout') === null")
        await page.evaluate("window.__marker = 'no reload'")
        await fleet_page.evaluate("window.__marker = 'no reload'")

        result = await asyncio.to_thread(sluice, "update", "echo", str(fleet.spec("b")),
                                         "--state-dir", str(fleet.state))  # fmt: skip
        assert result.exit_code == 0, result.output

        await page.wait_for("document.querySelector('#rollout') !== null", timeout=20,
                            what="the rollout panel, live")  # fmt: skip
        assert "v2" in await page.evaluate(
            "document.querySelector('#rollout [data-col=rollout-text]').textContent")
        await fleet_page.wait_for(
            "!!document.querySelector('tr[data-service=echo] [data-col=rollout] .badge')",
            what="the fleet row's rollout, live")
        for scheme in ("light", "dark"):
            for name, tab in (("service", page), ("fleet", fleet_page)):
                await tab.color_scheme(scheme)
                shot = await tab.screenshot(SHOTS / f"{name}-rollout-{scheme}.png")
                print(f"screenshot: {shot}")

        # The new version takes over: every row v2 and READY, as status says; no panel.
        await page.wait_for(
            "document.querySelector('#rollout') === null && "
            "[...document.querySelectorAll('#replicas [data-col=version]')]"
            ".every(td => td.textContent === 'v2')", timeout=40,
            what="the rollout to finish on the page")
        rows = await _matches_status(page, fleet, "rows after the rollout to match status")
        assert rows and {r["version"] for r in rows} == {2}
        for tab in (page, fleet_page):
            assert await tab.evaluate("window.__marker") == "no reload"
            await tab.color_scheme("light")
        assert await page.evaluate(
            "[...document.querySelectorAll('#events [data-kind]')].some("
            "li => li.dataset.kind === 'update')")
        await page.screenshot(SHOTS / "service-after-light.png")
        assert page.console_errors == [] and fleet_page.console_errors == [], (
            page.console_errors, fleet_page.console_errors)
    print(f"browser test: {time.monotonic() - started:.1f} s; screenshots in {SHOTS}")


async def test_strings_from_redis_are_text_never_code(fleet: Fleet) -> None:
    """A proxy id, an event reason (also a replica's status reason) and a replica URL
    carrying markup: shown literally, no element made from them, nothing run."""

    async def plant(store: Store) -> None:
        beat = ProxyHeartbeat(generation=1, applied_at=time.time(), seen_at=time.time() + 60,
                              connected=True)  # fmt: skip
        client = aioredis.from_url(fleet.redis_url)
        try:  # a proxy's own key: any proxy may write its id there
            await client.hset(store.keys.proxies("echo"), XSS, msgspec.json.encode(beat))
        finally:
            await client.aclose()
        first = min(int(k) for k in await store.replicas("echo"))
        await store.append_event("echo", "failure", {"replica": first, "reason": XSS})

    await asyncio.to_thread(store_call, fleet.redis_url, fleet.prefix, plant)
    url = "http://127.0.0.1:9/" + XSS.replace(" ", "/")
    added = await asyncio.to_thread(sluice, "replica", "add", "echo", url,
                                    "--state-dir", str(fleet.state))  # fmt: skip
    assert added.exit_code == 0, added.output
    async with Chromium.launch(fleet.tmp / "xss") as browser:
        page = await browser.new_page()
        await page.goto(fleet.dashboard + "/service/echo")
        await page.wait_for(
            f"[...document.querySelectorAll('#proxies [data-col=id]')]"
            f".some(td => td.textContent === {json.dumps(XSS)})", what="the planted proxy id")
        await page.wait_for(
            f"document.querySelector('#events').textContent.includes({json.dumps(XSS)})",
            what="the planted event reason")
        await page.wait_for(
            "[...document.querySelectorAll('#replicas [data-col=url]')]"
            ".some(td => td.textContent.includes('onerror=window.__xss=1'))",
            what="the planted replica URL")
        assert await page.evaluate("document.querySelectorAll('main img').length") == 0
        assert await page.evaluate("window.__xss === undefined")
        await page.screenshot(SHOTS / "service-xss-light.png")
        assert page.console_errors == [], page.console_errors


class EngineView(msgspec.Struct, frozen=True):
    """Shaped like the engine-telemetry view: replica id -> that replica's engine."""

    replicas: dict[str, dict[str, Any]]


class EngineTelemetry(Telemetry):
    """Engine views with an entry of any text (`read_engines`)."""

    async def read_engines(self, name: str) -> EngineView:  # type: ignore[override]
        return EngineView({"1": {"engine": "llamacpp", "waiting": 3, "running": 2,
                                 "kv_usage": 0.5, "ttft_p50": 0.125, "error": XSS}})  # fmt: skip


async def test_engine_columns_and_ttft_chart_when_engines_report(
    redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path,
) -> None:  # fmt: skip
    """With engine telemetry in the store, the service page grows an Engine column
    (queue, running, KV usage; other fields as text) and a TTFT chart; a replica without
    one shows a dash. (In-process dashboard on a real redis-server, real Chromium.)"""
    store = Store(redis_client, prefix=redis_prefix)
    store.telemetry = EngineTelemetry(redis_client, store.keys, time.time, store.rejects)
    await registered(store, "svc", spec=make_spec(2).to_json())
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    poller = Poller(store, interval=0.2)
    await poller.step()
    config = DashboardConfig(port=free_port())
    runner = web.AppRunner(make_app(poller, config), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, HOST, config.port).start()
    await poller.start()
    try:
        async with Chromium.launch(tmp_path) as browser:
            page = await browser.new_page()
            await page.goto(f"http://{HOST}:{config.port}/service/svc")
            cell = await page.wait_for(
                "document.querySelector('tr[data-replica-id=\"1\"] [data-col=engine]')"
                "?.textContent", what="replica 1's engine cell")
            assert cell == "llamacpp · queue 3 · running 2 · KV 50%"
            assert await page.evaluate(
                "document.querySelector('tr[data-replica-id=\"2\"] [data-col=engine]')"
                ".textContent") == "—"
            await page.wait_for("!!document.querySelector('[data-chart=ttft] path')",
                                what="the TTFT chart")  # fmt: skip
            title = await page.evaluate(
                "document.querySelector('tr[data-replica-id=\"1\"] [data-col=engine] span')"
                ".title")
            assert XSS in title and "ttft_p50=0.125" in title
            assert await page.evaluate("document.querySelectorAll('main img').length") == 0
            await page.screenshot(SHOTS / "service-engines-light.png")
            assert page.console_errors == [], page.console_errors
    finally:
        await runner.cleanup()
        await poller.aclose()


async def test_routing_reasons_chart_and_errors_from_heartbeat_counters(
    redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path,
) -> None:  # fmt: skip
    """Two successive heartbeats of a proxy whose prefix policy counts reasons: the
    service page draws the routing-reasons chart (a line per reason) and the errors/s
    chart, the fleet page shows errors/s. (In-process dashboard on a real redis-server,
    heartbeats written as a proxy writes them, real Chromium.)"""
    store = Store(redis_client, prefix=redis_prefix)
    await registered(store, "svc", spec=make_spec(2).to_json())
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    poller = Poller(store, interval=0.2)
    config = DashboardConfig(port=free_port())
    runner = web.AppRunner(make_app(poller, config), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, HOST, config.port).start()
    key = store.keys.proxies("svc")
    t = time.time() + 30  # ahead of the clock: fresh for the whole test
    for n, at in enumerate((t, t + 1.0)):
        beat = ProxyHeartbeat(generation=1, seen_at=at, connected=True,
                              responses={"2xx": 100 * n, "5xx": 4 * n}, cuts=n,
                              routed={"affinity": 30 * n, "spill": 5 * n, "fallback": 2 * n})
        await redis_client.hset(key, "p1", msgspec.json.encode(beat))
        await poller.step()
    await poller.start()
    try:
        async with Chromium.launch(tmp_path) as browser:
            page = await browser.new_page()
            await page.goto(f"http://{HOST}:{config.port}/service/svc")
            await page.wait_for("document.querySelectorAll('[data-chart=routing] path')"
                                ".length >= 3", what="the routing-reasons chart")  # fmt: skip
            text = await page.evaluate(
                "document.querySelector('[data-chart=routing]').textContent")
            assert all(r in text for r in ("affinity", "spill", "fallback")), text
            await page.wait_for("!!document.querySelector('[data-chart=errors] path')",
                                what="the errors/s chart")  # fmt: skip
            await page.screenshot(SHOTS / "service-routing-light.png")
            fleet_page = await browser.new_page()
            await fleet_page.goto(f"http://{HOST}:{config.port}/")
            shown = await fleet_page.wait_for(
                "document.querySelector('tr[data-service=svc] [data-col=errors]')?.textContent",
                what="the fleet row's errors/s")  # fmt: skip
            assert shown == "5", shown  # (4 5xx + 1 cut) / 1 s
            assert page.console_errors == [] and fleet_page.console_errors == []
    finally:
        await runner.cleanup()
        await poller.aclose()
