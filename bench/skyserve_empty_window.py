"""Drop-in mode: what clients see when the Sky Serve controller answers one sync with
an empty set (its count-only-update gap), at a steady request rate, with the quick
resync on and off. Prints a table; not a test.

    python bench/skyserve_empty_window.py [--rate 20] [--seconds 30] [--sync-interval 5]

Uses the stub controller from tests/support/skyserve_stub.py (a named fake: the real one
needs a cloud), two bench/fast_replica.py replicas and a real sluice-proxy process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.pids import interrupt_on_sigterm  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.skyserve_stub import StubController  # noqa: E402


async def wait_http(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer 200")
            await asyncio.sleep(0.05)


async def scenario(quick: bool, args: argparse.Namespace) -> dict[str, float]:
    procs: list[subprocess.Popen[bytes]] = []
    stub = StubController()
    try:
        ports = [free_port(), free_port()]
        for p in ports:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench/fast_replica.py"),
                                           "--port", str(p)], stdout=subprocess.DEVNULL))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        full = {u: "unknown" for u in urls}
        stub.script = [full]
        await stub.start(free_port())
        port, admin = free_port(), free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "--controller-addr", stub.url,
             "--port", str(port), "--admin-port", str(admin), "--log-level", "WARNING",
             "--sync-interval", str(args.sync_interval),
             "--quick-resync" if quick else "--no-quick-resync"], cwd=ROOT))
        await wait_http(f"http://127.0.0.1:{admin}/readyz")
        latencies: list[float] = []
        codes: dict[int, int] = {}

        async def one(session: aiohttp.ClientSession) -> None:
            t0 = time.monotonic()
            try:
                async with session.get(f"http://127.0.0.1:{port}/") as resp:
                    await resp.read()
                    code = resp.status
            except (aiohttp.ClientError, TimeoutError):
                code = 0
            latencies.append(time.monotonic() - t0)
            codes[code] = codes.get(code, 0) + 1

        n = int(args.rate * args.seconds)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session, asyncio.TaskGroup() as tg:
            for i in range(n):
                if i == n // 3:
                    stub.script = [{}, full]  # the next sync answers empty, then the set again
                tg.create_task(one(session))
                await asyncio.sleep(1 / args.rate)
        latencies.sort()
        return {
            "sent": n,
            "2xx": sum(c for k, c in codes.items() if 200 <= k < 300),
            "non_2xx": sum(c for k, c in codes.items() if not 200 <= k < 300),
            "slow_over_2s": sum(1 for x in latencies if x > 2.0),
            "max_s": latencies[-1],
        }
    finally:
        await stub.aclose()
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--sync-interval", type=float, default=5.0)
    args = ap.parse_args()
    rows = [("on", await scenario(True, args)), ("off", await scenario(False, args))]
    print(f"\nOne empty sync at {args.rate:g} req/s, sync interval {args.sync_interval:g} s, "
          f"empty-wait 10 s (default)\n")
    print("| quick resync | sent | 2xx | non-2xx | slower than 2 s | max latency |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['sent']} | {r['2xx']} | {r['non_2xx']} | {r['slow_over_2s']} "
              f"| {r['max_s'] * 1000:.0f} ms |")


if __name__ == "__main__":
    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    asyncio.run(main())
