"""Drain until idle under `sluice run` defaults: long streams through a rolling update,
then through a count-only scale-down 3 -> 2. Prints a table; not a test.

    python bench/drain_gap.py [--streams 30] [--stream-seconds 20] [--new-per-second 1]

`sluice run` (its defaults: no --drain-seconds) serves a 2-replica service of
loadtests/replica.py (an SSE chat-completions stand-in, one token every 20 ms) on a
free port, against a private redis-server this script starts (so it can read the
service's events; `--redis` is the only non-default flag). Per phase it opens
`--streams` streams of `--stream-seconds` at once, then one new stream every
second, and after 3 s changes the fleet:

- rolling: a spec change (a new env), rolling update of 2 replicas;
- scale-down: first a count-only update to 3 (waited for, no streams), then the
  streams, then a count-only update to 2.

New streams stop once the fleet settled (the retired replicas are gone); every
stream is then waited for. Per phase: streams completed / cut / failed, and per
retired replica the streams it served, when its last stream ended, when the
controller recorded it terminated (its `terminate` event: the process had exited),
and the gap between the two. All on 127.0.0.1; every process is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane import ops  # noqa: E402
from controlplane.redisserver import EmbeddedRedis  # noqa: E402
from controlplane.servicespec import ServiceSpec, parse_spec  # noqa: E402
from controlplane.store import Store  # noqa: E402
from tests.support.pids import interrupt_on_sigterm  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

NAME = "llm"
TOKEN_DELAY = 0.02


def spec_doc(replicas: int, revision: int) -> dict[str, object]:
    return {
        "name": NAME,
        "service": {
            "readiness_probe": {"path": "/health", "initial_delay_seconds": 60,
                                "endpoint_probe_interval_seconds": 1},
            "replicas": replicas,
        },
        "envs": {"REPLICA_VERSION": str(revision), "REPLICA_LOAD_SECONDS": "1",
                 "REPLICA_HEALTH_DELAY": "0", "REPLICA_TOKEN_DELAY": f"{TOKEN_DELAY:g}"},
        "workdir": str(ROOT),
        "run": f"exec {shlex.quote(sys.executable)} loadtests/replica.py",
    }  # fmt: skip


def spec(replicas: int, revision: int) -> ServiceSpec:
    return parse_spec(spec_doc(replicas, revision))


@dataclass
class Stream:
    started: float
    replica: str = "-"
    ended: float = 0.0
    outcome: str = "unfinished"


@dataclass
class Phase:
    name: str
    streams: list[Stream] = field(default_factory=list)
    retired: dict[int, float] = field(default_factory=dict)  # replica id -> terminate `at`


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int, s: Stream) -> None:
    body = {"stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "x"}]}
    got, done = 0, False
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            s.replica = resp.headers.get("X-Replica-Id", "-")
            if resp.status != 200:
                s.outcome = f"HTTP {resp.status}"
                return
            s.outcome = "cut"
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    got += 1
            if done and got >= tokens:
                s.outcome = "completed"
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.outcome = "cut" if s.outcome == "cut" else type(exc).__name__
    finally:
        s.ended = time.time()


async def settled(store: Store, n: int, version: int | None, timeout: float = 120) -> None:
    def done(v: ops.ServiceView) -> bool:
        return len(v.replicas) == n and all(
            r.status == "READY" and (version is None or r.version == version)
            for r in v.replicas)  # fmt: skip

    await ops.wait_for(store, NAME, done, timeout, interval=0.2)


async def run_phase(store: Store, url: str, args: argparse.Namespace, phase: Phase,
                    change: object) -> None:  # fmt: skip
    tokens = round(args.stream_seconds / TOKEN_DELAY)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    before = {e.id for e in await store.events(NAME, 10_000)}
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        def start() -> None:
            s = Stream(time.time())
            phase.streams.append(s)
            tasks.append(asyncio.create_task(one_stream(session, url, tokens, s)))

        for _ in range(args.streams):
            start()
        stop = asyncio.Event()

        async def trickle() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0 / args.new_per_second)
                if not stop.is_set():
                    start()

        trickler = asyncio.create_task(trickle())
        await asyncio.sleep(3.0)
        assert callable(change)
        await change()
        stop.set()
        await trickler
        await asyncio.gather(*tasks)
    for event in await store.events(NAME, 10_000):
        if event.id not in before and event.kind == "terminate":
            phase.retired[int(event.fields["replica"])] = event.at


def report(phase: Phase) -> list[str]:
    outcomes: dict[str, int] = {}
    for s in phase.streams:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    lines = [f"### {phase.name}", "",
             f"streams: {len(phase.streams)}; " + ", ".join(
                 f"{k}: {v}" for k, v in sorted(outcomes.items())), "",
             "| retired replica | streams served | last stream ended | terminated | gap s |",
             "|---|---:|---|---|---:|"]  # fmt: skip
    for replica_id, stopped in sorted(phase.retired.items()):
        served = [s for s in phase.streams if s.replica == str(replica_id)]
        last = max((s.ended for s in served), default=None)
        gap = f"{stopped - last:.2f}" if last is not None else "n/a"
        lines.append(f"| {replica_id} | {len(served)} | "
                     f"{time.strftime('%H:%M:%S', time.localtime(last)) if last else '-'} | "
                     f"{time.strftime('%H:%M:%S', time.localtime(stopped))} | {gap} |")
    return lines


async def wait_endpoint(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sluice run exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/v1/models") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError("the endpoint never answered")


async def main_async(args: argparse.Namespace, workdir: Path) -> list[str]:
    redis = EmbeddedRedis(workdir / "redis")
    redis.start()
    proc: subprocess.Popen[bytes] | None = None
    store = Store.from_url(redis.url)
    try:
        yaml = workdir / "llm.yaml"
        import json

        yaml.write_text(json.dumps(spec_doc(2, 1)))  # JSON is YAML
        port = free_port()
        env = {**os.environ, "SLUICE_REDIS_URL": redis.url, "PYTHONPATH": str(ROOT)}
        log = (workdir / "run.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "run", str(yaml), "--host", "127.0.0.1",
             "--port", str(port), "--state-dir", str(workdir / "state")],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        await wait_endpoint(url, proc)
        await settled(store, 2, None)
        out: list[str] = []

        rolling = Phase("rolling update (spec change), 2 replicas")

        async def roll() -> None:
            version = await ops.update(store, NAME, spec(2, 2))
            await settled(store, 2, version, timeout=180)

        await run_phase(store, url, args, rolling, roll)
        out += [*report(rolling), ""]

        await ops.update(store, NAME, spec(3, 2))
        await settled(store, 3, None)
        down = Phase("count-only scale-down 3 -> 2")

        async def shrink() -> None:
            await ops.update(store, NAME, spec(2, 2))
            await settled(store, 2, None, timeout=180)

        await run_phase(store, url, args, down, shrink)
        out += report(down)
        return out
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        await store.aclose()
        redis.stop()


def main() -> int:
    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=30)
    p.add_argument("--stream-seconds", type=float, default=20.0)
    p.add_argument("--new-per-second", type=float, default=1.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-drain-gap-") as tmp:
        lines = asyncio.run(main_async(args, Path(tmp)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
