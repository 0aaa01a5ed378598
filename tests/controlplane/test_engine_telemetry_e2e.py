"""Engine telemetry end to end, with real llama.cpp engines: a controller (run(), real
clock) launches llama-server replicas through the local backend, scrapes them, and
publishes their queues; `sluice status -v` and a real sluice-proxy's `/metrics` show
each replica's load within seconds of a change; a queue-length autoscaled service
scales up under a queue and back down after it.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controlplane import ops
from controlplane.reconcile import ControllerConfig
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.store import Store
from tests.support.cli import sluice
from tests.support.controllers import proxy_for
from tests.support.fakes import StartController, controller_config
from tests.support.llama import MODEL_ALIAS, binary, launch_env, model_path, unavailable
from tests.support.poll import until
from tests.support.processes import REPO, ProxyFactory

pytestmark = pytest.mark.slow

PROBE = {"path": "/health", "endpoint_probe_interval_seconds": 0.3, "timeout_seconds": 2,
         "initial_delay_seconds": 60}  # fmt: skip
LIVE = {"PROVISIONING", "PENDING", "STARTING", "READY", "NOT_READY"}


def llama_run(slots: int, ctx: int) -> str:
    """The `run:` of a llama-server replica on $PORT (the local backend sets it)."""
    argv = [str(binary()), "-m", str(model_path()), "--host", "127.0.0.1", "--port", "$PORT",
            "-np", str(slots), "-t", "1", "--cache-ram", "0", "-c", str(ctx), "--metrics",
            "--no-webui", "-a", MODEL_ALIAS]  # fmt: skip
    env = launch_env()["LD_LIBRARY_PATH"]
    return f"LD_LIBRARY_PATH={shlex.quote(env)} exec " + " ".join(
        a if a == "$PORT" else shlex.quote(a) for a in argv)


def spec(service: dict[str, Any], *, slots: int = 1, ctx: int = 2048) -> ServiceSpec:
    return parse_spec({"service": {"readiness_probe": PROBE, **service},
                       "run": llama_run(slots, ctx)})  # fmt: skip


@pytest.fixture
def config(redis_url: str, redis_prefix: str, tmp_path: Path) -> ControllerConfig:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    model_path()  # written once, before any replica needs it
    return controller_config(redis_url, redis_prefix, tmp_path, lease_ttl=10.0,
                             drain_seconds=1.0, reconcile_interval=1.0,
                             autoscaler_interval=0.5, autoscaler_zero_interval=0.5)  # fmt: skip


class Load:
    """Long chat completions kept in flight against `url` (each its own prompt)."""

    def __init__(self, url: str, concurrency: int, max_tokens: int = 300) -> None:
        self.url, self.concurrency, self.max_tokens = url, concurrency, max_tokens
        self.statuses: list[int] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = False

    async def _worker(self, session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not self._stop:
            n += 1
            body = {"messages": [{"role": "user", "content": f"w{i} r{n} " + "x " * 200}],
                    "max_tokens": self.max_tokens, "temperature": 0}  # fmt: skip
            async with session.post(f"{self.url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                self.statuses.append(resp.status)

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        self._tasks = [asyncio.create_task(self._worker(self._session, i))
                       for i in range(self.concurrency)]  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()


def engine_gauge(metrics: str, name: str, service: str) -> dict[str, float]:
    """replica URL -> value of `sluice_engine_<name>` for `service` in a /metrics page."""
    out = {}
    pattern = re.compile(rf'^sluice_engine_{name}\{{([^}}]*)\}} (\S+)$', re.M)
    for labels, value in pattern.findall(metrics):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("service") == service:
            out[fields["replica"]] = float(value)
    return out


async def test_status_and_metrics_show_each_replicas_queue_within_seconds(
    store: Store, redis_url: str, redis_prefix: str, start_controller: StartController,
    proxy_factory: ProxyFactory,
) -> None:  # fmt: skip
    await start_controller()
    await ops.up(store, "llm", spec({"replicas": 2}, slots=1))
    await ops.wait_for(store, "llm", lambda v: v.ready == 2, timeout=60)
    url = await proxy_for(proxy_factory, redis_url, redis_prefix, "llm")
    proxy = proxy_factory.started[-1]

    def status_v() -> str:
        result = sluice("status", "llm", "-v", "--redis", redis_url, "--prefix", redis_prefix)
        assert result.exit_code == 0, result.output
        return result.output

    idle = await asyncio.to_thread(status_v)
    assert "ENGINE" in idle and "WAITING" in idle

    started = time.monotonic()
    async with Load(url, concurrency=6):  # 2 replicas x 1 slot: 4 wait in the engines

        async def queued() -> bool:
            view = (await ops.status(store, "llm"))[0]
            waits = [e.waiting or 0 for e in view.engines.values()]
            return len(waits) == 2 and sum(waits) >= 2

        await until(queued, timeout=15, what="the engines' queues in the published view")
        in_view = time.monotonic() - started
        busy = await asyncio.to_thread(status_v)

        async def exported() -> bool:
            _, body = await asyncio.to_thread(proxy.admin_get, "/metrics")
            running = engine_gauge(body.decode(), "requests_running", "llm")
            waiting = engine_gauge(body.decode(), "requests_waiting", "llm")
            return len(running) == 2 and sum(running.values()) >= 1 and sum(
                waiting.values()) >= 1

        await until(exported, timeout=15, what="the proxy to re-export the engines' load")
        in_metrics = time.monotonic() - started
    rows = [line for line in busy.splitlines() if "llamacpp" in line]
    assert len(rows) == 2, busy
    print(f"\nload started: queues in the view after {in_view:.1f}s, in the proxy's /metrics "
          f"after {in_metrics:.1f}s\n{busy}")

    async def drained() -> bool:
        view = (await ops.status(store, "llm"))[0]
        return all((e.running, e.waiting) == (0, 0) for e in view.engines.values())

    await until(drained, timeout=30, what="the queues to drain in the view")


async def test_a_queue_length_autoscaled_service_scales_up_under_a_queue_and_back_down(
    store: Store, redis_url: str, redis_prefix: str, start_controller: StartController,
    proxy_factory: ProxyFactory,
) -> None:  # fmt: skip
    await start_controller()
    policy = {"min_replicas": 1, "max_replicas": 2, "target_queue_length_per_replica": 1,
              "upscale_delay_seconds": 2, "downscale_delay_seconds": 4}  # fmt: skip
    await ops.up(store, "llm", spec({"replica_policy": policy}, slots=1))
    await ops.wait_for(store, "llm", lambda v: v.ready == 1, timeout=60)
    url = await proxy_for(proxy_factory, redis_url, redis_prefix, "llm")
    async with Load(url, concurrency=4) as load:  # 1 slot: 3 wait -> ceil(3 / 1), clipped
        up = await ops.wait_for(store, "llm", lambda v: v.ready == 2, timeout=60)
    assert up.autoscaler is not None and up.autoscaler.queue is not None
    assert load.statuses and set(load.statuses) == {200}, set(load.statuses)
    down = await ops.wait_for(
        store, "llm", lambda v: len([r for r in v.replicas if r.status in LIVE]) == 1,
        timeout=60)
    assert down.target == 1 and down.autoscaler is not None
    assert down.autoscaler.reason == "downscale", down.autoscaler
    assert "engine queue" in (down.autoscaling or "")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tgi"])
async def test_the_other_engines_formats_reach_status(
    store: Store, redis_url: str, redis_prefix: str, start_controller: StartController,
    engine: str,
) -> None:  # fmt: skip
    """Replicas serving the fake of vLLM's, SGLang's or TGI's metric format, launched by
    the controller like any replica: `sluice status -v` names the engine."""
    await start_controller()
    run = (f"exec {sys.executable} -m tests.support.engine_fake --port $PORT "
           f"--engine {engine} --slots 2")
    doc = {"service": {"readiness_probe": PROBE, "replicas": 1}, "run": run,
           "workdir": str(REPO)}  # fmt: skip
    await ops.up(store, "fake", parse_spec(doc))
    await ops.wait_for(store, "fake", lambda v: v.ready == 1, timeout=30)

    async def scraped() -> bool:
        view = (await ops.status(store, "fake"))[0]
        return [e.engine for e in view.engines.values()] == [engine]

    await until(scraped, timeout=15, what=f"the {engine} replica to be scraped")
    result = await asyncio.to_thread(
        sluice, "status", "fake", "-v", "--redis", redis_url, "--prefix", redis_prefix)
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("SERVICE_NAME"))
    head, row = lines[header], lines[header + 1]
    cells = row[head.index("ENGINE"):head.index("KV")].split()  # columns are aligned
    assert cells == [engine, "0", "0"], result.output
