"""The rollout-loss benchmark: steady load through sluice while the fleet changes.

    python loadtests/rollout.py --scenario all --json rollout.json
    python loadtests/rollout.py --scenario count-only --updates 10 --duration 60

Per scenario, on 127.0.0.1 only, in a fresh temporary state dir, it starts:

1. a private redis-server (`EmbeddedRedis`, persist=True: append-only file with
   fsync on every write, so `redis-restart` keeps the state);
2. the controller, `python -m controlplane.cli controller ...` (a child process);
3. sluice-proxy, `python -m proxy.cli --redis URL --service llm ...`;
4. the service `llm` (`ops.up`): local replicas running `loadtests/replica.py`,
   an SSE chat-completions server whose readiness path answers 503 for
   `--load-seconds` and takes `--health-delay` seconds per answer, like a busy
   model server; or, with `--engine llama`, real llama-server engines (tests/support/llama.py: one
   CPU thread each, the random-weight test model, `--slots` slots; long streams of
   `--stream-tokens` tokens; who served what from the proxy's access log);

waits until its replicas are READY and the proxy routes to them, then drives
`--rate` requests/s with locust headless (`loadtests/locustfile.py`, a
subprocess, open loop) and, after a short warm-up, performs the scenario:

    count-only           --updates N count-only updates, replicas 3, 2, 3, 2, ...
    rolling              a spec change (a new env), rolling update of 2 replicas
    blue-green           the same change, blue_green
    scale-down           3 replicas to 1 (count-only)
    kill-replica         SIGKILL one READY replica (its process group)
    redis-restart        SIGKILL redis-server, restart it on the same port, then 2 -> 3
    redis-stall          SIGSTOP redis-server for 4 s (longer than the lease), then 2 -> 3
    controller-restart   SIGKILL the controller, start a new one, then 2 -> 3

The load goes on until the scenario is done and `--duration` seconds have
passed (at least `--tail` seconds after the last change), then stops; requests
still in flight get one request deadline to end. Then one table per scenario:
requests sent, 2xx, non-2xx by code, requests with no answer, timed out (hung),
cut streams, slow requests, the long streams (`--long-streams N` at the
start, then `--stream-rate` per second, each of `--stream-seconds`, 20 s by default:
completed, cut, failed; loadtests/streams.py), replicas launched and terminated (the service's
events stream, counted from the start of the load) against what the scenario
needs, and checks: replicas that must survive kept their pid, every replica
launched under load served requests. `--json FILE` writes it all.

Exit status 1 when any request was lost (non-2xx, no answer, timed out, cut,
unfinished) or a check failed; streams cut on the SIGKILLed replica are the
one allowed loss (counted, shown, never hung). Every process started here is
stopped by pid, also on Ctrl-C or SIGTERM; the state dir (logs) is removed
unless `--keep` or a scenario failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a clone, without an install
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from controlplane import ops  # noqa: E402
from controlplane.processes import die_with_parent_hook, free_port, running, signal_group  # noqa: E402
from controlplane.records import UpdateMode  # noqa: E402
from controlplane.redisserver import EmbeddedRedis  # noqa: E402
from controlplane.servicespec import ServiceSpec, parse_spec  # noqa: E402
from controlplane.store import Store  # noqa: E402
from loadtests.streams import LongStreams, describe  # noqa: E402

SERVICE = "llm"
LOCUSTFILE = REPO / "loadtests" / "locustfile.py"
_POLL = 0.1


@dataclass(frozen=True, kw_only=True)
class Options:
    rate: float = 20.0
    duration: float = 40.0  # least seconds of load per scenario
    updates: int = 10
    warmup: float = 3.0
    tail: float = 4.0
    timeout: float = 20.0  # request deadline
    slow: float = 2.0
    mix: str = "stream:2,chat:1,get:1"
    max_tokens: int = 32
    load_seconds: float = 3.0
    health_delay: float = 1.0
    token_delay: float = 0.02
    resume_streams: bool = False  # the service's service.sluice.resume_streams
    drain_seconds: float = 120.0  # the controller's maximum drain (it stops when idle)
    long_streams: int = 6  # long streams at the start of the load
    stream_rate: float = 0.5  # then new long streams per second
    stream_seconds: float = 20.0  # each long stream's length
    lease_ttl: float = 3.0
    engine: str = "python"  # the replicas: "python" (loadtests/replica.py) or "llama"
    stream_tokens: int = 0  # max_tokens of a long stream (0: stream_seconds / token_delay)
    slots: int = 8  # llama-server -np (a slot per concurrent request; more wait in its queue)
    settle_timeout: float = 60.0
    keep: bool = False
    state_root: Path | None = None


# -- the processes -----------------------------------------------------------------------------


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(_POLL)
    return True


class Processes:
    """Every process this run starts, so that all are stopped by pid whatever happens.

    Children are spawned from the main thread (PR_SET_PDEATHSIG is per thread) in their
    own sessions, so a Ctrl-C on the terminal reaches only this script, which stops them.
    Replicas are the controller's children; their handles (pid, start time) are noted
    here as they are seen, and any still running at the end is killed by process group.
    """

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[bytes]] = []
        self.redis: list[EmbeddedRedis] = []
        self.replicas: dict[int, int | None] = {}  # pid -> its start time
        self.handle_dirs: list[Path] = []  # where the local backend writes replica-ID.json

    def spawn(self, argv: list[str], log: Path, *, cwd: Path = REPO) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent_hook(),
            )
        self.children.append(proc)
        return proc

    def note_replica(self, handle: dict[str, Any]) -> None:
        pid = handle.get("pid")
        if isinstance(pid, int) and pid > 0:
            start = handle.get("start_time")
            self.replicas[pid] = start if isinstance(start, int) else None

    def scan_handles(self) -> None:
        """Note the replicas whose handle files the local backend left (it removes a file
        once the replica is terminated): a controller may launch some after we looked."""
        for directory in self.handle_dirs:
            for path in directory.glob("replica-*.json"):
                with contextlib.suppress(OSError, ValueError):
                    handle = json.loads(path.read_text())
                    if isinstance(handle, dict):
                        self.note_replica(handle)

    def kill_replicas(self) -> int:
        """SIGKILL the process group of every noted replica still running; how many."""
        self.scan_handles()
        killed = 0
        for pid, start in self.replicas.items():
            if running(pid, start):  # not gone, and not a recycled pid
                signal_group(pid, signal.SIGKILL)
                killed += 1
                print(f"  killed leftover replica process group {pid}", file=sys.stderr)
        return killed

    def kill_all(self) -> None:
        """The last resort (also after Ctrl-C): SIGKILL whatever is still running."""
        for proc in self.children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.kill_replicas()
        for server in self.redis:
            server.stop(timeout=2.0)


# -- the service -------------------------------------------------------------------------------


def stream_tokens(options: Options) -> int:
    """max_tokens of one long stream."""
    if options.stream_tokens > 0:
        return options.stream_tokens
    return max(1, min(4096, round(options.stream_seconds / max(options.token_delay, 1e-3))))


def llama_spec(options: Options, replicas: int, *, revision: int = 1) -> ServiceSpec:
    """The service with real llama.cpp replicas (tests/support/llama.py): llama-server on
    $PORT, one CPU thread, the random-weight test model, `slots` slots, each with room
    for a long stream; its /health answers 503 while the model loads."""
    from tests.support import llama

    ctx = options.slots * (stream_tokens(options) + max(options.max_tokens, 256) + 256)
    run = llama.run_command(llama.model_path(), slots=options.slots, threads=1, ctx=ctx)
    return parse_spec(
        {
            "name": SERVICE,
            "service": {
                "readiness_probe": {
                    "path": "/health",
                    "initial_delay_seconds": 60,
                    "timeout_seconds": 5,
                    "endpoint_probe_interval_seconds": 1,
                },
                "replicas": replicas,
                **({"sluice": {"resume_streams": True}} if options.resume_streams else {}),
            },
            "envs": {**llama.launch_env(), "REPLICA_VERSION": str(revision)},
            "workdir": str(REPO),
            "run": run,
        }
    )


def service_spec(options: Options, replicas: int, *, revision: int = 1) -> ServiceSpec:
    """The load test's service. A new `revision` changes an env: a spec change (new
    replicas); a new `replicas` alone is a count-only change (a relabel)."""
    if options.engine == "llama":
        return llama_spec(options, replicas, revision=revision)
    return parse_spec(
        {
            "name": SERVICE,
            "service": {
                "readiness_probe": {
                    "path": "/health",
                    "initial_delay_seconds": 60,
                    "timeout_seconds": max(5.0, options.health_delay + 2),
                    "endpoint_probe_interval_seconds": 1,
                },
                "replicas": replicas,
                **({"sluice": {"resume_streams": True}} if options.resume_streams else {}),
            },
            "envs": {
                "REPLICA_VERSION": str(revision),
                "REPLICA_LOAD_SECONDS": f"{options.load_seconds:g}",
                "REPLICA_HEALTH_DELAY": f"{options.health_delay:g}",
                "REPLICA_TOKEN_DELAY": f"{options.token_delay:g}",
            },
            "workdir": str(REPO),
            "run": f"exec {shlex.quote(sys.executable)} loadtests/replica.py",
        }
    )


class Stack:
    """Redis, controller, proxy, the service and the load for one scenario.

    Built by `start()`; torn down by `aclose()` in reverse: load, proxy, controller,
    leftover replicas, Redis. The scenario verbs below act on it.
    """

    def __init__(self, options: Options, state_dir: Path, processes: Processes) -> None:
        self.options = options
        self.state_dir = state_dir
        self.processes = processes
        self.redis = EmbeddedRedis(state_dir / "redis", persist=True)
        self.store: Store | None = None
        self.http: aiohttp.ClientSession | None = None
        self.controller: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.locust: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.admin_port = 0
        self.controllers = 0
        self.load_started: float | None = None  # wall clock of the first request sent
        self.timeline: list[tuple[float, str]] = []
        self.pids: dict[int, int] = {}  # replica id -> pid, as last seen
        self.report_path = state_dir / "locust-report.json"
        self.streams: LongStreams | None = None
        self.stream_report: dict[str, Any] = {}
        self.urls: dict[str, int] = {}  # replica URL -> id, as last seen
        # Real engines send no X-Replica-Id: who served what comes from the access log.
        self.access_log = state_dir / "access.log" if options.engine == "llama" else None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, replicas: int) -> None:
        self.processes.handle_dirs.append(self.state_dir / SERVICE)
        self.processes.redis.append(self.redis)
        self.redis.start()  # from the main thread: it dies with this one
        self.store = Store.from_url(self.redis.url)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.start_controller()
        self.port, self.admin_port = free_port(), free_port()
        self.proxy = self.processes.spawn(
            [sys.executable, "-m", "proxy.cli", "--redis", self.redis.url,
             "--service", SERVICE, "--host", "127.0.0.1", "--port", str(self.port),
             "--admin-port", str(self.admin_port), "--shutdown-grace", "5",
             "--log-level", "info",
             *(["--access-log", str(self.access_log)] if self.access_log else [])],
            self.state_dir / "proxy.log",
        )  # fmt: skip
        await self._until(self._proxy_up, 30, "the proxy to listen")
        await ops.up(self.store, SERVICE, service_spec(self.options, replicas),
                     endpoint=self.endpoint)  # fmt: skip
        await self.settled(replicas)

    async def aclose(self) -> list[str]:
        """Stop everything; returns what went wrong on the way (a controller that ignored
        SIGTERM, replicas it left running)."""
        issues: list[str] = []
        try:
            await self.stop_load()
        finally:
            try:
                if not await self._stop(self.proxy, 10):
                    issues.append("the proxy ignored SIGTERM for 10s (killed)")
                # --terminate-on-exit: the controller stops the replicas as it exits.
                grace = self.options.drain_seconds + 15
                if not await self._stop(self.controller, grace):
                    issues.append(f"the controller ignored SIGTERM for {grace:g}s (killed)")
            finally:
                if left := self.processes.kill_replicas():
                    issues.append(f"the controller left {left} replicas running (killed)")
                if self.http is not None:
                    await self.http.close()
                if self.store is not None:
                    await self.store.aclose()
                self.redis.stop(timeout=5)
        return issues

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def start_controller(self) -> None:
        self.controllers += 1
        o = self.options
        self.controller = self.processes.spawn(
            [sys.executable, "-m", "controlplane.cli", "controller", "--redis", self.redis_url,
             "--state-dir", str(self.state_dir), "--drain-seconds", f"{o.drain_seconds:g}",
             "--lease-ttl", f"{o.lease_ttl:g}", "--reconcile-interval", "1",
             "--term-timeout", "5", "--terminate-on-exit",
             "--holder", f"loadtest-controller-{self.controllers}"],
            self.state_dir / f"controller-{self.controllers}.log",
        )  # fmt: skip

    async def _stop(self, proc: subprocess.Popen[bytes] | None, grace: float) -> bool:
        """SIGTERM, SIGKILL after `grace`; False if it came to that."""
        if proc is None or proc.poll() is not None:
            return True
        proc.send_signal(signal.SIGTERM)
        if await _wait_exit(proc, grace):
            return True
        proc.kill()
        proc.wait()
        return False

    # -- the load ----------------------------------------------------------------------------

    async def start_load(self) -> None:
        o = self.options
        # Hard cap on the load's length, should this script be unable to stop it.
        cap = int(o.duration + o.settle_timeout * (o.updates + 2) + 60)
        self.locust = self.processes.spawn(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
             "-u", "1", "-r", "1", "-H", self.endpoint, "--run-time", f"{cap}s",
             "--only-summary", "--loglevel", "INFO",
             "--sluice-rate", f"{o.rate:g}", "--sluice-mix", o.mix,
             "--sluice-timeout", f"{o.timeout:g}", "--sluice-slow-threshold", f"{o.slow:g}",
             "--sluice-max-tokens", str(o.max_tokens), "--sluice-report", str(self.report_path)],
            self.state_dir / "locust.log",
            cwd=self.state_dir,
        )  # fmt: skip
        await self._until(self._load_flowing, 60, "locust to send its first request")
        report = json.loads(self.report_path.read_text())
        self.load_started = float(report["first_sent_at"])
        if o.long_streams or o.stream_rate > 0:
            self.streams = LongStreams(self.endpoint, count=o.long_streams,
                                       rate=o.stream_rate, seconds=o.stream_seconds,
                                       tokens=stream_tokens(o),
                                       started_at=self.load_started)  # fmt: skip
            await self.streams.start()

    async def stop_load(self) -> dict[str, Any] | None:
        """SIGTERM locust (it gives requests in flight one deadline), read its report."""
        proc, self.locust = self.locust, None
        streams, self.streams = self.streams, None
        if streams is not None:
            self.stream_report = await streams.stop()
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if not await _wait_exit(proc, self.options.timeout + 30):
            proc.kill()
            proc.wait()
            raise RuntimeError("locust did not stop on SIGTERM (log: locust.log)")
        report: dict[str, Any] = json.loads(self.report_path.read_text())
        if report.get("state") != "finished":
            raise RuntimeError("locust exited without its final report (log: locust.log)")
        return report

    async def _load_flowing(self) -> bool:
        if self.locust is not None and self.locust.poll() is not None:
            raise RuntimeError(f"locust exited with {self.locust.returncode} (log: locust.log)")
        return self.report_path.exists()

    # -- scenario verbs ----------------------------------------------------------------------

    def mark(self, what: str) -> None:
        at = time.time() - (self.load_started or time.time())
        self.timeline.append((round(at, 2), what))
        print(f"  +{at:5.1f}s  {what}", file=sys.stderr, flush=True)

    async def update(
        self, replicas: int, *, revision: int = 1, mode: UpdateMode | None = None
    ) -> int:
        assert self.store is not None
        spec = service_spec(self.options, replicas, revision=revision)
        version = await ops.update(self.store, SERVICE, spec, mode=mode)
        what = "count-only" if revision == 1 else f"spec change ({mode or 'rolling'})"
        self.mark(f"update to version {version}: {what}, {replicas} replicas")
        return version

    async def settled(
        self, n: int, *, version: int | None = None, without: int | None = None
    ) -> ops.ServiceView:
        """Until n replicas, all READY (of `version`), none draining, replica `without`
        gone, and the proxy routes to n."""
        assert self.store is not None
        view = await ops.wait_for(
            self.store,
            SERVICE,
            lambda v: (
                len(v.replicas) == n
                and all(r.status == "READY" for r in v.replicas)
                and (version is None or all(r.version == version for r in v.replicas))
                and all(r.id != without for r in v.replicas)
            ),
            # A retired replica drains its long streams first (they may run slow).
            timeout=self.options.settle_timeout + 2 * self.options.stream_seconds,
            interval=0.1,
        )
        await self.note_replicas()
        await self._until(lambda: self._proxy_routes(n), 10, f"the proxy to route to {n}")
        if self.load_started is not None:
            ids = ",".join(str(r.id) for r in sorted(view.replicas, key=lambda r: r.id))
            self.mark(f"settled: replicas {ids} READY")
        return view

    async def note_replicas(self) -> None:
        assert self.store is not None
        for replica_id, record in (await self.store.replicas(SERVICE)).items():
            if record.handle:
                self.processes.note_replica(record.handle)
                pid = record.handle.get("pid")
                if isinstance(pid, int):
                    self.pids[replica_id] = pid
            if record.url:
                self.urls[str(record.url)] = replica_id

    def served_by_replica(self) -> dict[str, int] | None:
        """Requests per replica id from the proxy's access log (its upstream field), or
        None without one (the replicas' own X-Replica-Id header counts then)."""
        if self.access_log is None:
            return None
        counts: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in self.access_log.read_text(errors="replace").splitlines():
                fields = line.rsplit(" ", 2)
                if len(fields) == 3 and (rid := self.urls.get(fields[1])) is not None:
                    counts[str(rid)] = counts.get(str(rid), 0) + 1
        return counts

    def kill_controller(self) -> None:
        assert self.controller is not None
        self.controller.kill()
        self.controller.wait()
        self.mark(f"SIGKILL controller {self.controllers} (pid {self.controller.pid})")

    def kill_redis(self) -> None:
        self.redis.kill()
        self.mark("SIGKILL redis-server")

    async def stall_redis(self, seconds: float) -> None:
        """SIGSTOP redis-server for `seconds` (a VM pause, a stuck disk), then SIGCONT."""
        pid = self.redis.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        self.mark(f"SIGSTOP redis-server for {seconds:g}s")
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.mark("SIGCONT redis-server")

    def restart_redis(self) -> None:
        self.redis.restart()  # the same port; the append-only file brings the state back
        self.mark(f"redis-server restarted (pid {self.redis.pid})")

    async def kill_replica(self, replica_id: int) -> None:
        await self.note_replicas()
        pid = self.pids[replica_id]
        os.killpg(pid, signal.SIGKILL)
        self.mark(f"SIGKILL replica {replica_id} (process group {pid})")

    async def lease_holder(self) -> str | None:
        assert self.store is not None
        return await self.store.lease_holder()

    async def events(self) -> list[tuple[str, dict[str, str], float]]:
        """(kind, fields, at) of the service's events since the load started."""
        assert self.store is not None
        start = self.load_started or 0.0
        return [(e.kind, e.fields, e.at) for e in await self.store.events(SERVICE, 10_000)
                if e.at >= start]  # fmt: skip

    async def proxy_metrics(self) -> dict[str, Any]:
        """Retries and responses by code, from the proxy's /metrics."""
        assert self.http is not None
        out: dict[str, Any] = {"retries": 0, "responses": {}}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            url = f"http://127.0.0.1:{self.admin_port}/metrics"
            async with self.http.get(url) as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("sluice_upstream_retries_total"):
                    out["retries"] = int(float(line.split()[-1]))
                elif line.startswith("sluice_stream_resumes_total{"):
                    outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                    resumes = out.setdefault("resumes", {})
                    resumes[outcome] = resumes.get(outcome, 0) + int(float(line.split()[-1]))
                elif line.startswith("sluice_responses_cut_total{"):
                    cause = line.split('cause="', 1)[1].split('"', 1)[0]
                    out.setdefault("cut", {})[cause] = int(float(line.split()[-1]))
                elif line.startswith("sluice_responses_total{"):
                    code = line.split('code="', 1)[1].split('"', 1)[0]
                    out["responses"][code] = int(float(line.split()[-1]))
        return out

    # -- waiting -----------------------------------------------------------------------------

    async def _until(self, check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not await check():
            if self.proxy is not None and self.proxy.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proxy.returncode} (proxy.log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:g}s for {what}")
            await asyncio.sleep(_POLL)

    async def _proxy_up(self) -> bool:
        assert self.http is not None
        try:
            async with self.http.get(f"http://127.0.0.1:{self.admin_port}/healthz") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _proxy_routes(self, n: int) -> bool:
        assert self.http is not None
        try:
            async with self.http.get(f"http://127.0.0.1:{self.admin_port}/readyz") as resp:
                body = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return int(body.get("replicas", -1)) == n


# -- the scenarios -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    launched: int
    terminated: int
    keep: tuple[int, ...] = ()  # replica ids that must keep their process
    cut_allowed: bool = False  # streams cut by a SIGKILLed replica are counted, not lost


@dataclass(frozen=True)
class Scenario:
    name: str
    initial: int
    run: Callable[[Stack], Awaitable[Expected]]
    about: Callable[[Options], str]
    stack: Callable[[Options, Path, Processes], Stack] | None = None


SERVE_PAUSE = 1.5  # after a new replica is READY: let it take its share before the next change


async def count_only(stack: Stack) -> Expected:
    updates = stack.options.updates
    for i in range(updates):
        n = 3 if i % 2 == 0 else 2
        await stack.update(n)
        await stack.settled(n)
        if n == 3:
            await asyncio.sleep(SERVE_PAUSE)
    return Expected(launched=math.ceil(updates / 2), terminated=updates // 2, keep=(1, 2))


async def rolling(stack: Stack) -> Expected:
    version = await stack.update(2, revision=2, mode=UpdateMode.ROLLING)
    await stack.settled(2, version=version)
    return Expected(launched=2, terminated=2)


async def blue_green(stack: Stack) -> Expected:
    version = await stack.update(2, revision=2, mode=UpdateMode.BLUE_GREEN)
    await stack.settled(2, version=version)
    return Expected(launched=2, terminated=2)


async def scale_down(stack: Stack) -> Expected:
    await stack.update(1)
    await stack.settled(1)
    return Expected(launched=0, terminated=2, keep=(1,))


async def kill_replica(stack: Stack) -> Expected:
    await stack.kill_replica(1)
    await stack.settled(2, without=1)
    await asyncio.sleep(SERVE_PAUSE)
    # Streams cut by the SIGKILL are allowed, unless they are to be resumed (docs/resume.md).
    return Expected(launched=1, terminated=1, keep=(2,),
                    cut_allowed=not stack.options.resume_streams)


async def redis_restart(stack: Stack) -> Expected:
    stack.kill_redis()
    await asyncio.sleep(2.0)  # down for a while, under load
    stack.restart_redis()
    await asyncio.sleep(2.0)
    await stack.update(3)  # the state survived, and the proxy follows changes again
    await stack.settled(3)
    await asyncio.sleep(SERVE_PAUSE)
    return Expected(launched=1, terminated=0, keep=(1, 2))


async def redis_stall(stack: Stack) -> Expected:
    await stack.stall_redis(4.0)  # longer than the lease TTL (3 s)
    await asyncio.sleep(8.0)  # the controller renews its lease, or steps down and back
    await stack.update(3)
    await stack.settled(3)
    await asyncio.sleep(SERVE_PAUSE)
    return Expected(launched=1, terminated=0, keep=(1, 2))


async def controller_restart(stack: Stack) -> Expected:
    old = await stack.lease_holder()
    stack.kill_controller()
    await asyncio.sleep(2.0)  # no controller at all for a while, under load
    stack.start_controller()

    async def new_leader() -> bool:
        return await stack.lease_holder() not in (None, old)

    await stack._until(new_leader, stack.options.lease_ttl + 30, "the new controller to lead")
    stack.mark(f"controller {stack.controllers} leads")
    await stack.update(3)  # the new controller adopted the replicas and acts
    await stack.settled(3)
    await asyncio.sleep(SERVE_PAUSE)
    return Expected(launched=1, terminated=0, keep=(1, 2))


async def redis_failover(stack: Stack) -> Expected:
    from loadtests.failover import redis_failover as run

    return await run(stack)


def failover_stack(options: Options, state_dir: Path, processes: Processes) -> Stack:
    from loadtests.failover import FailoverStack

    return FailoverStack(options, state_dir, processes)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("count-only", 2, count_only,
                 lambda o: f"{o.updates} count-only updates, replicas 3, 2, 3, ..."),
        Scenario("rolling", 2, rolling, lambda o: "spec change (new env), rolling, 2 replicas"),
        Scenario("blue-green", 2, blue_green,
                 lambda o: "spec change (new env), blue_green, 2 replicas"),
        Scenario("scale-down", 3, scale_down, lambda o: "count-only update from 3 replicas to 1"),
        Scenario("kill-replica", 2, kill_replica, lambda o: "SIGKILL replica 1 of 2"),
        Scenario("redis-restart", 2, redis_restart,
                 lambda o: "SIGKILL redis-server, restart after 2 s, then 2 -> 3 replicas"),
        Scenario("redis-stall", 2, redis_stall,
                 lambda o: "SIGSTOP redis-server for 4 s (> lease TTL), then 2 -> 3 replicas"),
        Scenario("controller-restart", 2, controller_restart,
                 lambda o: "SIGKILL the controller, a new one after 2 s, then 2 -> 3 replicas"),
        Scenario("redis-failover", 2, redis_failover,
                 lambda o: "sentinels, 4 proxies x 2 workers, 2 controllers: SIGKILL the "
                           "primary, 2 -> 3, SIGKILL the leader, rolling update",
                 failover_stack),
    )
}  # fmt: skip


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Result:
    scenario: str
    about: str
    passed: bool = False
    reasons: list[str] = field(default_factory=list)
    error: str | None = None
    load_seconds: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    launched: int = 0
    terminated: int = 0
    expected: Expected | None = None
    proxy: dict[str, Any] = field(default_factory=dict)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    state_dir: str = ""
    convergence: dict[str, Any] = field(default_factory=dict)  # redis-failover only
    streams: dict[str, Any] = field(default_factory=dict)  # the long streams' outcomes

    @property
    def cut_streams(self) -> int:
        return int(self.report.get("by_kind", {}).get("stream", {}).get("cut", 0))

    @property
    def lost(self) -> int:
        """Requests lost, less the streams a SIGKILLed replica may cut."""
        lost = int(self.report.get("lost", 0))
        streams = self.streams
        cut_allowed = self.expected is not None and self.expected.cut_allowed
        if cut_allowed:
            lost -= self.cut_streams
        lost += streams.get("failed", 0) + streams.get("unfinished", 0)
        if not cut_allowed:
            lost += streams.get("cut", 0)
        return lost

    def to_json(self) -> dict[str, Any]:
        r = self.report
        return {
            "scenario": self.scenario,
            "about": self.about,
            "passed": self.passed,
            "reasons": self.reasons,
            "error": self.error,
            "load_seconds": round(self.load_seconds, 1),
            "rate": r.get("rate"),
            "achieved_rate": r.get("achieved_rate"),
            "sent": r.get("sent", 0),
            "ok_2xx": r.get("ok", 0),
            "non_2xx": r.get("non_2xx", {}),
            "no_answer": r.get("errors", {}),
            "timed_out": r.get("timeout", 0),
            "cut": r.get("cut", 0),
            "cut_streams": self.cut_streams,
            "cut_allowed": bool(self.expected and self.expected.cut_allowed),
            "unfinished": r.get("unfinished", 0),
            "slow": r.get("slow", 0),
            "slow_threshold": r.get("slow_threshold"),
            "lost": self.lost,
            "latency_ms": r.get("latency_ms", {}),
            "replicas_launched": self.launched,
            "replicas_terminated": self.terminated,
            "expected_launched": self.expected.launched if self.expected else None,
            "expected_terminated": self.expected.terminated if self.expected else None,
            "served_by_replica": r.get("by_replica", {}),
            "proxy": self.proxy,
            "timeline": self.timeline,
            "failures": _failures(r, self.report.get("first_sent_at")),
            "state_dir": self.state_dir,
            "convergence": self.convergence,
            "long_streams": self.streams,
        }


def _failures(report: dict[str, Any], start: float | None) -> list[dict[str, Any]]:
    """The locust samples (failures, slow requests) with their send time from load start."""
    out = []
    for sample in report.get("samples", [])[:200]:
        sample = dict(sample)
        if start is not None and sample.get("sent_at") is not None:
            sample["at"] = round(sample.pop("sent_at") - start, 2)
        out.append(sample)
    return out


async def run_scenario(
    scenario: Scenario, options: Options, processes: Processes, state_root: Path
) -> Result:
    result = Result(scenario.name, scenario.about(options))
    state_dir = Path(tempfile.mkdtemp(prefix=f"{scenario.name}-", dir=state_root))
    result.state_dir = str(state_dir)
    stack = (scenario.stack or Stack)(options, state_dir, processes)
    print(f"\n{scenario.name}: {result.about}", file=sys.stderr, flush=True)
    try:
        await stack.start(scenario.initial)
        initial = dict(stack.pids)
        await stack.start_load()
        stack.mark(f"load: {options.rate:g} req/s to {stack.endpoint}")
        await asyncio.sleep(options.warmup)
        result.expected = await scenario.run(stack)
        assert stack.load_started is not None
        elapsed = time.time() - stack.load_started
        await asyncio.sleep(max(options.tail, options.duration - elapsed))
        stack.mark("stopping the load")
        result.report = await stack.stop_load() or {}
        result.streams = stack.stream_report
        result.load_seconds = time.time() - stack.load_started
        stack.mark("load stopped")
        events = await stack.events()
        result.launched = sum(1 for kind, _, _ in events if kind == "launch")
        result.terminated = sum(1 for kind, _, _ in events if kind == "terminate")
        await stack.note_replicas()
        result.proxy = await stack.proxy_metrics()
        await asyncio.sleep(0.3)  # the access log is written every 100 ms
        if (served := stack.served_by_replica()) is not None:
            result.report["by_replica"] = served
        result.reasons = _check(result, initial, stack.pids, events)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.reasons.append(f"scenario failed: {result.error}")
        if stack.locust is not None:
            with contextlib.suppress(Exception):
                result.report = await stack.stop_load() or {}
            result.streams = stack.stream_report
    finally:
        result.timeline = stack.timeline
        result.convergence = getattr(stack, "convergence_report", {})
        teardown = await stack.aclose()
    result.reasons += [f"teardown: {issue}" for issue in teardown]
    result.passed = not result.reasons
    if result.passed and not options.keep:
        shutil.rmtree(state_dir, ignore_errors=True)
    return result


def _check(
    result: Result,
    initial: dict[int, int],
    pids: dict[int, int],
    events: list[tuple[str, dict[str, str], float]],
) -> list[str]:
    expected = result.expected
    assert expected is not None
    report = result.report
    reasons = []
    if result.lost:
        reasons.append(f"{result.lost} requests lost")
    if (report.get("achieved_rate") or 0) < 0.95 * report.get("rate", 0):
        reasons.append(f"the load ran at {report.get('achieved_rate')} req/s only")
    if result.launched != expected.launched:
        reasons.append(f"{result.launched} replicas launched, {expected.launched} needed")
    if result.terminated != expected.terminated:
        reasons.append(f"{result.terminated} replicas terminated, {expected.terminated} expected")
    for replica_id in expected.keep:
        if pids.get(replica_id) != initial.get(replica_id):
            reasons.append(f"replica {replica_id} was replaced or lost its process")
    served = report.get("by_replica", {})
    new_ids = [f["replica"] for kind, f, _ in events if kind == "launch"]
    idle = [i for i in new_ids if not served.get(i)]
    if idle:
        reasons.append(f"replicas launched under load never served: {', '.join(idle)}")
    return reasons


# -- output ------------------------------------------------------------------------------------


def _codes(counts: dict[str, int]) -> str:
    if not counts:
        return "0"
    return f"{sum(counts.values())} (" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + ")"


def table(result: Result) -> str:
    row = result.to_json()
    latency = row["latency_ms"] or {}
    cut = str(row["cut"])
    if row["cut_allowed"]:
        cut += f" ({row['cut_streams']} streams in flight on the killed replica: allowed)"
    lines = [
        f"== {result.scenario}: {result.about}",
        f"   {row['load_seconds']:g} s of load at {row['rate']} req/s "
        f"(achieved {row['achieved_rate']}); state: {row['state_dir']}",
    ]
    rows = [
        ("requests sent", row["sent"]),
        ("2xx", row["ok_2xx"]),
        ("non-2xx by code", _codes(row["non_2xx"])),
        ("no answer, by error", _codes(row["no_answer"])),
        ("timed out (hung)", row["timed_out"]),
        ("cut (ended early)", cut),
        ("unfinished at stop", row["unfinished"]),
        (f"slower than {row['slow_threshold']} s", row["slow"]),
        ("latency p50/p99/max ms",
         f"{latency.get('p50')} / {latency.get('p99')} / {latency.get('max')}"),
        ("replicas launched", f"{row['replicas_launched']} (needed {row['expected_launched']})"),
        ("replicas terminated",
         f"{row['replicas_terminated']} (expected {row['expected_terminated']})"),
        ("long streams", describe(row["long_streams"]) if row["long_streams"] else "none"),
        ("proxy retries", row["proxy"].get("retries", "-")),
        ("stream resumes", ", ".join(f"{k} {v}" for k, v in
                                     row["proxy"].get("resumes", {}).items()) or "0"),
        ("proxy cut responses", _codes(row["proxy"].get("cut", {}))),
        ("lost", row["lost"]),
        ("result", "PASS" if result.passed else "FAIL: " + "; ".join(result.reasons)),
    ]  # fmt: skip
    lines += [f"   {name:<24} {value}" for name, value in rows]
    if result.convergence:
        from loadtests.failover import convergence_table

        lines.append(convergence_table(result.convergence))
    failures = [f for f in row["failures"] if f["outcome"] != "ok"][:10]
    if failures:
        lines.append("   first failures (seconds from load start):")
        lines += [
            f"     +{f.get('at', 0):6.2f}s {f['kind']:<6} {f['outcome']:<8} "
            f"status={f['status']} replica={f['replica']} {f['latency']}s {f['error'] or ''}"
            for f in failures
        ]
    cuts = (row["long_streams"] or {}).get("cuts", [])[:10]
    if cuts:
        lines.append("   long streams not completed (seconds from load start):")
        lines += [f"     +{c['at']:6.2f}s {c['outcome']:<7} replica={c['replica']} "
                  f"{c['seconds']}s {c['tokens']} tokens {c['error']}" for c in cuts]
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    head = ("scenario", "sent", "2xx", "non-2xx", "no answer", "hung", "cut", "slow",
            "long ok", "long cut", "launched", "terminated", "lost", "result")  # fmt: skip
    rows = [head]
    for r in results:
        j = r.to_json()
        rows.append((
            r.scenario, str(j["sent"]), str(j["ok_2xx"]), _codes(j["non_2xx"]),
            _codes(j["no_answer"]), str(j["timed_out"]), str(j["cut"]), str(j["slow"]),
            str(r.streams.get("completed", "-")),
            str(r.streams.get("cut", 0) + r.streams.get("failed", 0)) if r.streams else "-",
            str(j["replicas_launched"]), str(j["replicas_terminated"]), str(j["lost"]),
            "PASS" if r.passed else "FAIL",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)  # fmt: skip


# -- main --------------------------------------------------------------------------------------


async def run_all(
    names: list[str], options: Options, processes: Processes, state_root: Path
) -> list[Result]:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)
    results = []
    for name in names:
        result = await run_scenario(SCENARIOS[name], options, processes, state_root)
        print(table(result), flush=True)
        results.append(result)
    return results


def parse_args(argv: list[str] | None = None) -> tuple[list[str], Options, Path | None]:
    d = Options()
    p = argparse.ArgumentParser(
        description="Steady load through sluice while the fleet changes; one table per "
        "scenario. Exit status 1 when a request was lost.",
    )
    p.add_argument(
        "--scenario",
        default="all",
        choices=["all", *SCENARIOS],
        help="which scenario (default: all, one after the other)",
    )
    p.add_argument(
        "--duration", type=float, default=d.duration, help="least seconds of load per scenario"
    )
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second")
    p.add_argument("--updates", type=int, default=d.updates, help="count-only updates")
    p.add_argument("--json", type=Path, help="write the results as JSON to this file")
    p.add_argument("--timeout", type=float, default=d.timeout, help="request deadline, s")
    p.add_argument("--slow-threshold", type=float, default=d.slow, help="slow request, s")
    p.add_argument("--mix", default=d.mix, help="locust request mix (stream:2,chat:1,get:1)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per answer")
    p.add_argument(
        "--load-seconds",
        type=float,
        default=d.load_seconds,
        help="a replica's /health is 503 this long after it starts",
    )
    p.add_argument(
        "--health-delay",
        type=float,
        default=d.health_delay,
        help="seconds each /health answer takes",
    )
    p.add_argument(
        "--drain-seconds", type=float, default=d.drain_seconds,
        help="the controller's maximum drain (it stops a replica once idle)",
    )
    p.add_argument("--long-streams", type=int, default=d.long_streams,
                   help="long streams at the start of the load (0 and --stream-rate 0: none)")
    p.add_argument("--stream-rate", type=float, default=d.stream_rate,
                   help="then new long streams per second")
    p.add_argument("--stream-seconds", type=float, default=d.stream_seconds,
                   help="each long stream's length, s")
    p.add_argument("--stream-tokens", type=int, default=d.stream_tokens,
                   help="max_tokens of a long stream (default: --stream-seconds over the "
                        "Python replica's token delay; set it for --engine llama)")
    p.add_argument("--engine", choices=["python", "llama"], default=d.engine,
                   help="the replicas: loadtests/replica.py, or real llama-server engines "
                        "(1 thread each, the random-weight test model; tests/support/llama.py)")
    p.add_argument("--slots", type=int, default=d.slots, help="llama-server slots (-np)")
    p.add_argument("--state-dir", type=Path, help="where logs go (default: a temporary dir)")
    p.add_argument("--keep", action="store_true", help="keep the state dir even on success")
    p.add_argument("--resume-streams", action="store_true",
                   help="the service resumes cut streams (service.sluice.resume_streams)")
    a = p.parse_args(argv)  # fmt: skip
    if a.rate <= 0 or a.duration <= 0 or a.updates < 0:
        p.error("--rate and --duration must be > 0, --updates >= 0")
    options = Options(
        rate=a.rate, duration=a.duration, updates=a.updates, timeout=a.timeout,
        slow=a.slow_threshold, mix=a.mix, max_tokens=a.max_tokens,
        load_seconds=a.load_seconds, health_delay=a.health_delay,
        drain_seconds=a.drain_seconds, keep=a.keep, state_root=a.state_dir,
        resume_streams=a.resume_streams,
        long_streams=a.long_streams, stream_rate=a.stream_rate,
        stream_seconds=a.stream_seconds, stream_tokens=a.stream_tokens, engine=a.engine,
        slots=a.slots,
    )  # fmt: skip
    if options.engine == "llama":
        from tests.support import llama

        if reason := llama.unavailable():
            p.error(f"--engine llama: {reason}")
    names = list(SCENARIOS) if a.scenario == "all" else [a.scenario]
    return names, options, a.json


def main(argv: list[str] | None = None) -> int:
    names, options, json_path = parse_args(argv)
    processes = Processes()
    results: list[Result] = []
    state_root = options.state_root or Path(tempfile.mkdtemp(prefix="sluice-rollout-"))
    state_root.mkdir(parents=True, exist_ok=True)
    try:
        results = asyncio.run(run_all(names, options, processes, state_root))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"\nrollout: interrupted; everything stopped (logs: {state_root})", file=sys.stderr)
        return 130
    finally:
        processes.kill_all()
    if all(r.passed for r in results) and not options.keep and options.state_root is None:
        shutil.rmtree(state_root, ignore_errors=True)
    print("\n" + summary(results))
    if json_path is not None:
        payload = {
            "options": {k: str(v) if isinstance(v, Path) else v
                        for k, v in vars(options).items()},
            "passed": all(r.passed for r in results),
            "scenarios": [r.to_json() for r in results],
        }  # fmt: skip
        json_path.write_text(json.dumps(payload, indent=1))
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
