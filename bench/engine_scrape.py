"""What engine telemetry costs the controller: scraping N replicas' metrics pages.

    python bench/engine_scrape.py                   # 100 replicas, 20 steps, 3 rounds
    python bench/engine_scrape.py --replicas 200 --steps 10

A child process serves one metrics page on N ports of 127.0.0.1 (one aiohttp app, N
sites): the fake of vLLM's format (tests/support/engine_fake.py) padded with the other
histogram families a vLLM V1 server exports (names from vllm/v1/metrics/loggers.py), so
the page is about the size of a real one. The controller's `EngineScraper` then steps
over all N, as it does every interval; the view is published to nothing (the Redis
write is one pipelined SET per service). Printed per round: wall time of one step
(all N scraped), controller CPU per step and per replica, the page size, and the cost
of `parse_metrics` alone on one page. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.engines.parse import parse_metrics  # noqa: E402
from controlplane.engines.scraper import EngineScraper, ScrapeTarget  # noqa: E402
from controlplane.store import Store  # noqa: E402
from tests.support.pids import interrupt_on_sigterm  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

# Histogram families of a vLLM V1 page that the scraper does not read (loggers.py).
_OTHER = ["vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
          "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:time_per_output_token_seconds",
          "vllm:inter_token_latency_seconds", "vllm:request_prompt_tokens",
          "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
          "vllm:request_params_max_tokens", "vllm:request_params_n"]  # fmt: skip


def page() -> bytes:
    from prometheus_client import Histogram

    from tests.support.engine_fake import Engine

    fake = Engine("vllm", 8, 0.0)
    buckets = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
    for name in _OTHER:
        h = Histogram(name, "padding", ["model_name", "engine"], buckets=buckets,
                      registry=fake.registry)  # fmt: skip
        h.labels(*fake.values).observe(1.0)
    fake.running, fake.waiting = 5, 3
    return fake.render()


SERVER = r"""
import sys
from aiohttp import web
body = sys.stdin.buffer.read()
ports = [int(p) for p in sys.argv[1:]]
async def metrics(request):
    return web.Response(body=body, content_type="text/plain")
async def main():
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for p in ports:
        await web.TCPSite(runner, "127.0.0.1", p).start()
    print("ready", flush=True)
    import asyncio
    await asyncio.Event().wait()
import asyncio
asyncio.run(main())
"""


class _NoTelemetry:
    async def write_engines(self, views: Any, ttl: float) -> None:
        return None


class _NoStore:
    telemetry = _NoTelemetry()


async def round_(ports: list[int], steps: int) -> tuple[float, float]:
    scraper = EngineScraper(cast(Store, _NoStore()), timeout=5.0, clock=time.time)
    await scraper.start()
    try:
        scraper.track("svc", [ScrapeTarget(i, f"http://127.0.0.1:{p}", interval=0.2)
                              for i, p in enumerate(ports)])  # fmt: skip
        await scraper.step()  # connections up
        walls, cpus = [], []
        for _ in range(steps):
            await asyncio.sleep(0.21)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await scraper.step()
            walls.append(time.perf_counter() - wall0)
            cpus.append(time.process_time() - cpu0)
        bad = [s for s in scraper.view("svc").replicas.values() if s.error]
        if bad:
            print(f"  {len(bad)} scrapes failed, e.g. {bad[0].error}")
        return statistics.median(walls), statistics.median(cpus)
    finally:
        await scraper.aclose()


def main() -> None:
    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    body = page()
    text = body.decode()
    n = 200
    t0 = time.process_time()
    for _ in range(n):
        parse_metrics(text)
    parse_us = (time.process_time() - t0) / n * 1e6
    ports = [free_port() for _ in range(args.replicas)]
    server = subprocess.Popen([sys.executable, "-c", SERVER, *map(str, ports)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    try:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(body)
        server.stdin.close()
        assert server.stdout.readline().strip() == b"ready"
        print(f"page: {len(body)} bytes, {text.count(chr(10))} lines; parse_metrics alone: "
              f"{parse_us:.0f} us CPU per page")
        print(f"{'round':>5} {'replicas':>8} {'step wall ms':>12} {'step CPU ms':>11} "
              f"{'CPU us/replica':>14}")
        for r in range(args.rounds):
            wall, cpu = asyncio.run(round_(ports, args.steps))
            print(f"{r + 1:>5} {args.replicas:>8} {wall * 1e3:>12.1f} {cpu * 1e3:>11.1f} "
                  f"{cpu / args.replicas * 1e6:>14.0f}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=5)


if __name__ == "__main__":
    main()
