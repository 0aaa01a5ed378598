"""Many concurrent SSE streams through one proxy process: memory and CPU per stream,
sluice-proxy (one worker) beside nginx (one worker, proxy_buffering off) in one run.

A replica process (this file, `--serve-replica`) answers every request with a chunked
text/event-stream that sends one small event every `--interval` seconds (1 s: a slow
LLM stream) until the client leaves; events are spread evenly over the interval. A
load-generator process (this file, `--loadgen`: raw asyncio protocols on uvloop)
opens `--streams` connections through the target, waits until each has its first
event, then the driver measures, over `--window` seconds, the target's CPU time
(/proc/PID/stat) and resident memory (VmRSS), and the events the clients got.
Rounds are interleaved (round 1: every target, round 2: every target, ...); each
round opens fresh streams and ends them with a reset (no TIME_WAIT left behind).

Each stream holds two descriptors in the proxy (client and replica sockets). When the
hard RLIMIT_NOFILE cannot hold `--streams` x 2 plus a reserve, the stream count is
lowered to fit and the table says so. All traffic is on 127.0.0.1; every process
started here is stopped by pid at the end.

    python bench/streams.py [--streams 10000] [--rounds 3] [--window 10] [--interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from proxy_overhead import (  # noqa: E402
    HOST,
    Processes,
    cpu_seconds,
    find_nginx,
    wait_until_up,
)

from tests.support.pids import descendants, interrupt_on_sigterm  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

EVENT = b'data: {"choices":[{"delta":{"content":"token"}}]}\n\n'
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
SLOTS = 100  # the interval is cut in this many slots; each stream writes in one of them
FD_RESERVE = 400  # descriptors a proxy needs besides its two per stream


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- the replica: slow SSE streams ---------------------------------------------------


class _SlowStream(asyncio.Protocol):
    def __init__(self, slots: list[set[asyncio.Transport]], counter: list[int]) -> None:
        self.slots = slots
        self.counter = counter
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.slot: set[asyncio.Transport] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.slot is not None or self.transport is None:
            return
        self.buf += data
        if b"\r\n\r\n" in self.buf:
            self.counter[0] += 1
            self.slot = self.slots[self.counter[0] % SLOTS]
            self.slot.add(self.transport)
            self.transport.write(SSE_HEAD + CHUNK)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.slot is not None and self.transport is not None:
            self.slot.discard(self.transport)
        self.transport = None


async def serve_replica(port: int, interval: float) -> None:
    loop = asyncio.get_running_loop()
    slots: list[set[asyncio.Transport]] = [set() for _ in range(SLOTS)]
    counter = [0]
    server = await loop.create_server(lambda: _SlowStream(slots, counter), HOST, port,
                                      backlog=4096)
    step = interval / SLOTS
    i = 0
    next_at = loop.time()
    async with server:
        while True:
            next_at += step
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            for t in list(slots[i % SLOTS]):
                t.write(CHUNK)
            i += 1


# -- the load generator: many cheap clients -------------------------------------------


class _Client(asyncio.Protocol):
    def __init__(self, gen: _LoadGen, request: bytes) -> None:
        self.gen = gen
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.up = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        gen = self.gen
        gen.events += data.count(b"data:")
        if not self.up and b"data:" in data:
            self.up = True
            gen.up += 1
            if gen.up + gen.failed >= gen.n:
                gen.all_up.set()

    def connection_lost(self, exc: Exception | None) -> None:
        gen = self.gen
        gen.lost += 1
        if not self.up:
            gen.failed += 1
            if gen.up + gen.failed >= gen.n:
                gen.all_up.set()
        self.transport = None


class _LoadGen:
    def __init__(self, n: int) -> None:
        self.n = n
        self.up = 0
        self.failed = 0
        self.lost = 0
        self.events = 0
        self.all_up = asyncio.Event()
        self.clients: list[_Client] = []


async def loadgen(port: int, n: int, concurrency: int) -> None:
    loop = asyncio.get_running_loop()
    gen = _LoadGen(n)
    request = f"GET /v1/stream HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    sem = asyncio.Semaphore(concurrency)

    async def open_one() -> None:
        async with sem:
            try:
                _, proto = await loop.create_connection(lambda: _Client(gen, request), HOST,
                                                        port)
                gen.clients.append(proto)
            except OSError:
                gen.failed += 1
                if gen.up + gen.failed >= gen.n:
                    gen.all_up.set()

    started = time.monotonic()
    tasks = [loop.create_task(open_one()) for _ in range(n)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(gen.all_up.wait(), 120)
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"up {gen.up} {gen.failed} {time.monotonic() - started:.2f}", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        if line.strip() == b"count":
            print(f"count {gen.events} {gen.lost}", flush=True)
    for c in gen.clients:
        if c.transport is not None:
            c.transport.abort()  # a reset: no TIME_WAIT on 10k loopback ports


# -- targets ---------------------------------------------------------------------------

NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile {nofile};
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
# nginx starts closing idle connections once fewer than 1/16 of worker_connections are
# free: set above the fd limit (allowed, with a warning) so only the fd limit binds.
events {{ worker_connections {conns}; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    server {{
        listen {host}:{port} backlog=4096;
        location / {{
            proxy_pass http://{replica};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
        location = /health {{ return 200 "ok"; }}
    }}
}}
"""


def start_target(name: str, procs: Processes, replica: str, log_dir: Path,
                 nofile: int) -> tuple[int, list[int]]:
    port = free_port()
    if name == "sluice":
        admin = free_port()
        argv = [sys.executable, "-m", "proxy.cli", "--replicas", f"http://{replica}",
                "--host", HOST, "--port", str(port), "--admin-port", str(admin),
                "--pool-size", "100000", "--stream-idle-timeout", "600",
                "--log-level", "WARNING"]  # fmt: skip
        checks = [(admin, "/readyz")]
    elif name == "nginx":
        nginx = find_nginx()
        if nginx is None:
            raise RuntimeError("nginx is not installed (apt-get install -y nginx-light)")
        prefix = log_dir / "nginx"
        (prefix / "tmp").mkdir(parents=True)
        if os.geteuid() == 0:  # nginx workers drop to nobody: let them into the prefix
            for p in (log_dir, prefix, prefix / "tmp"):
                p.chmod(0o755)
        conf = prefix / "nginx.conf"
        conf.write_text(NGINX_CONF.format(prefix=prefix, host=HOST, port=port, replica=replica,
                                          nofile=nofile, conns=nofile * 5 // 4))
        argv = [nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
        checks = [(port, "/health")]
    else:
        raise ValueError(name)
    proc = procs.start(name, argv)
    try:
        wait_until_up(proc, checks, within=30)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{procs.log_tail(name)}") from None
    return port, [proc.pid, *descendants(proc.pid)]


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def one_round(port: int, pids: list[int], n: int, window: float,
              procs: Processes, tag: str) -> dict[str, Any]:
    rss_idle = rss_bytes(pids)
    cpu0 = cpu_seconds(pids)
    gen = subprocess.Popen(
        [sys.executable, __file__, "--loadgen", "--port", str(port), "--streams", str(n)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    procs.started.append((f"loadgen-{tag}", gen, open(os.devnull, "wb")))  # type: ignore[arg-type]
    assert gen.stdin is not None and gen.stdout is not None
    up_line = gen.stdout.readline().split()
    if not up_line or up_line[0] != "up":
        raise RuntimeError(f"load generator failed: {up_line}")
    up, failed, ramp = int(up_line[1]), int(up_line[2]), float(up_line[3])
    cpu_ramp = cpu_seconds(pids) - cpu0
    gen.stdin.write("count\n")
    gen.stdin.flush()
    ev0 = int(gen.stdout.readline().split()[1])
    c0, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(window)
    c1, t1 = cpu_seconds(pids), time.monotonic()
    rss = rss_bytes(pids)
    gen.stdin.write("count\n")
    gen.stdin.flush()
    _, ev1, lost = gen.stdout.readline().split()
    gen.stdin.close()
    gen.wait(30)
    elapsed = t1 - t0
    cpu = c1 - c0
    return {
        "streams": up, "failed": failed, "lost_in_window": int(lost), "ramp_s": ramp,
        "ramp_cpu_s": cpu_ramp, "window_s": elapsed, "cpu_s": cpu,
        "cpu_pct": 100 * cpu / elapsed,
        "cpu_us_per_stream_s": 1e6 * cpu / (max(up, 1) * elapsed),
        "events_per_s": (int(ev1) - ev0) / elapsed,
        "cpu_us_per_event": 1e6 * cpu / max(1, int(ev1) - ev0),
        "rss_mb": rss / 2**20, "rss_idle_mb": rss_idle / 2**20,
        "rss_kib_per_stream": (rss - rss_idle) / 1024 / max(up, 1),
    }


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=10000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=10.0, help="measured seconds per round")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between events")
    p.add_argument("--targets", default="sluice,nginx")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--serve-replica", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    import uvloop

    if args.serve_replica:
        raise_nofile()
        uvloop.run(serve_replica(args.serve_replica, args.interval))
        return
    if args.loadgen:
        raise_nofile()
        uvloop.run(loadgen(args.port, args.streams, 256))
        return

    nofile = raise_nofile()
    n = min(args.streams, (nofile - FD_RESERVE) // 2)
    if n < args.streams:
        print(f"note: the fd limit ({nofile}) holds {n} streams per proxy, not "
              f"{args.streams}", file=sys.stderr)
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-streams-"))
    if os.geteuid() == 0:
        log_dir.chmod(0o755)  # nginx workers (nobody) reach their prefix below it
    procs = Processes(log_dir)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        rport = free_port()
        rep = procs.start("replica", [sys.executable, __file__, "--serve-replica", str(rport),
                                      "--interval", str(args.interval)])
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError):
                import socket
                socket.create_connection((HOST, rport), timeout=1).close()
                break
            if rep.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(procs.log_tail("replica"))
            time.sleep(0.05)
        replica = f"{HOST}:{rport}"
        names = args.targets.split(",")
        results = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names:
                # A fresh target each round: its idle RSS is the baseline of this round.
                sub = log_dir / f"{name}-{r}"
                sub.mkdir()
                target = Processes(sub)
                try:
                    port, pids = start_target(name, target, replica, sub, nofile)
                    res = one_round(port, pids, n, args.window, target, f"{name}-{r}")
                finally:
                    target.stop_all()
                results[name].append(res)
                print(f"round {r + 1} {name}: {json.dumps(res)}", file=sys.stderr)
                time.sleep(1)  # the replica sees the resets before the next round
    finally:
        procs.stop_all()
        shutil.rmtree(log_dir, ignore_errors=True)
    base = results.get("nginx")
    print(f"\n{n} SSE streams, 1 event / {args.interval:g} s each, one proxy process; "
          f"median (min-max) of {args.rounds} rounds, {args.window:g} s windows; "
          f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print("| target | streams up | CPU % of a core | CPU µs per stream-second | "
          "CPU µs per event | RSS MB (idle) | RSS KiB per stream | ramp s | vs nginx CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rounds in results.items():
        ratio = ""
        if base and name != "nginx":
            rs = [a["cpu_us_per_stream_s"] / b["cpu_us_per_stream_s"]
                  for a, b in zip(rounds, base, strict=False) if b["cpu_s"] > 0]
            ratio = (f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"
                     if rs else "")
        print(f"| {name} | {min(x['streams'] for x in rounds)} | "
              f"{spread([x['cpu_pct'] for x in rounds])} | "
              f"{spread([x['cpu_us_per_stream_s'] for x in rounds])} | "
              f"{spread([x['cpu_us_per_event'] for x in rounds])} | "
              f"{spread([x['rss_mb'] for x in rounds])} "
              f"({statistics.median([x['rss_idle_mb'] for x in rounds]):.0f}) | "
              f"{spread([x['rss_kib_per_stream'] for x in rounds])} | "
              f"{spread([x['ramp_s'] for x in rounds])} | {ratio} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"streams": n, "results": results},
                                                   indent=1))


if __name__ == "__main__":
    main()
