"""What a proxy costs: sluice-proxy against direct, a plain aiohttp proxy and nginx.

Starts two fast replicas (bench/fast_replica.py) and each target in front of
them, then measures in one interleaved run (round 1: every target, round 2:
every target, ...) requests/s, p50/p99 latency and CPU µs per request of the
target's processes; then streaming time-to-first-byte through each target,
interleaved the same way. Prints a markdown table; ``--json FILE`` writes
every number. All traffic goes to 127.0.0.1; every process started here is
stopped by pid at the end, also on Ctrl-C or error.

    python bench/proxy_overhead.py [--duration 5] [--rounds 3] [--connections 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from tests.support.pids import descendants  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
ALL_TARGETS = ("direct", "sluice-w1", "sluice-w2", "aiohttp", "nginx")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the given live processes (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


class Processes:
    """Every process this run started; stop_all() ends them by pid, newest first."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # closed in stop_all
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
        self.started.append((name, proc, log))
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop_all(self, timeout: float = 10.0) -> None:
        family = {p.pid: descendants(p.pid) for _, p, _ in self.started if p.poll() is None}
        for _, proc, _ in reversed(self.started):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc, log in reversed(self.started):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for pid in [proc.pid, *family.get(proc.pid, [])]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
            log.close()


def http_status(port: int, path: str) -> int:
    with socket.create_connection((HOST, port), timeout=2) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        return int(s.recv(4096).split()[1])


def wait_until_up(
    proc: subprocess.Popen[bytes], checks: list[tuple[int, str]], within: float
) -> None:
    deadline = time.monotonic() + within
    for port, path in checks:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode}")
            with contextlib.suppress(OSError, ValueError, IndexError):
                if http_status(port, path) == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not answering {path} on :{port} after {within}s")
            time.sleep(0.05)


@dataclass
class Target:
    name: str
    port: int
    pids: list[int]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    ttfb_ms: list[float] = field(default_factory=list)
    sock: socket.socket | None = None


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    upstream replicas {{
{servers}
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
        location /sse {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def start_target(
    name: str, procs: Processes, replica_urls: list[str], log_dir: Path, sluice_args: list[str]
) -> Target:
    port = free_port()
    checks = [(port, "/fast")]
    if name == "direct":
        raise AssertionError("direct is not started")
    if name.startswith("sluice-w"):
        # "sluice-w1@prefix": one worker, --policy prefix (compare policies in one run).
        base, _, policy = name.partition("@")
        workers = int(base.removeprefix("sluice-w"))
        if policy:
            sluice_args = [*sluice_args, "--policy", policy]
        admin = free_port(workers)  # worker i serves admin on admin + i
        argv = [sys.executable, "-m", "proxy.cli", "--replicas", ",".join(replica_urls),
                "--host", HOST, "--port", str(port), "--admin-port", str(admin),
                "--workers", str(workers), *sluice_args]  # fmt: skip
        checks[:0] = [(admin + i, "/readyz") for i in range(workers)]
    elif name == "aiohttp":
        argv = [sys.executable, str(BENCH / "aiohttp_baseline.py"), "--port", str(port),
                "--replicas", ",".join(replica_urls)]  # fmt: skip
    elif name == "nginx":
        nginx = find_nginx()
        if nginx is None:
            raise RuntimeError("nginx is not installed")
        prefix = log_dir / "nginx"
        (prefix / "tmp").mkdir(parents=True)
        if os.geteuid() == 0:  # nginx workers drop to nobody: let them into the prefix
            for p in (log_dir, prefix, prefix / "tmp"):
                p.chmod(0o755)
        servers = "\n".join(f"        server {u.split('://')[1]};" for u in replica_urls)
        conf = prefix / "nginx.conf"
        conf.write_text(NGINX_CONF.format(prefix=prefix, servers=servers, host=HOST, port=port))
        argv = [nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    else:
        raise ValueError(f"unknown target {name!r}; choose from {', '.join(ALL_TARGETS)}")
    proc = procs.start(name, argv)
    try:
        wait_until_up(proc, checks, within=30)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{procs.log_tail(name)}") from None
    return Target(name, port, [proc.pid, *descendants(proc.pid)])


LATENCY_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def parse_wrk(out: str) -> dict[str, Any]:
    def latency(pct: str) -> float:
        m = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
        return float(m.group(1)) * LATENCY_UNITS[m.group(2)] if m else float("nan")

    m = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)", out)
    if m is None:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    seconds = float(m.group(2)) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[m.group(3)]
    sock_err = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
    )
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "requests": int(m.group(1)),
        "seconds": seconds,
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
        "errors": sum(map(int, sock_err.groups())) if sock_err else 0,
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
    }


def chat_bodies(n: int = 16) -> list[str]:
    """Chat-shaped POST bodies (~2 KB): 4 system prompts x 4 questions."""
    systems = [f"You are assistant {i} of the support team. " + "Answer briefly and cite the "
               "relevant policy section by number. " * 24 for i in range(4)]
    return [json.dumps({"model": "m", "stream": True, "max_tokens": 64, "messages": [
        {"role": "system", "content": systems[i % 4]},
        {"role": "user", "content": f"Question {i}: how do I return an order? " * 3}]})
            for i in range(n)]


def run_load(
    loadgen: str, url: str, connections: int, threads: int, duration: float,
    body_file: Path | None = None,
) -> dict[str, Any]:
    if loadgen == "wrk" and body_file is not None:
        raise RuntimeError("--request chat needs the built-in load generator (--loadgen builtin)")
    if loadgen == "wrk":
        seconds = max(1, round(duration))  # wrk takes whole seconds
        argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency",
                "--timeout", "5s", url]  # fmt: skip
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=duration + 30, check=True
        )
        return parse_wrk(out.stdout)
    argv = [sys.executable, str(BENCH / "loadgen.py"), url, "-c", str(connections),
            "-d", str(duration)]  # fmt: skip
    if body_file is not None:
        argv += ["--body-file", str(body_file)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 30, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def measure(
    t: Target, replica_pids: list[int], run: Callable[[str], dict[str, Any]]
) -> dict[str, Any]:
    cpu0, rcpu0 = cpu_seconds(t.pids), cpu_seconds(replica_pids)
    result = run(f"http://{HOST}:{t.port}/fast")
    result["cpu_s"] = cpu_seconds(t.pids) - cpu0
    result["replica_cpu_s"] = cpu_seconds(replica_pids) - rcpu0
    return result


def ttfb_once(t: Target, delay: float) -> float:
    """ms from the request sent to the first SSE event's bytes; reads the whole stream."""
    if t.sock is None:
        t.sock = socket.create_connection((HOST, t.port), timeout=5)
        t.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock = t.sock
    request = f"GET /sse?delay={delay} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    buf, first = b"", None
    try:
        start = time.perf_counter()
        sock.sendall(request)
        while first is None or not (b"data: last" in buf and buf.endswith(b"0\r\n\r\n")):
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed mid-stream")
            buf += data
            if first is None and b"data: first" in buf:
                first = time.perf_counter()
    except BaseException:
        t.sock = None
        sock.close()
        raise
    if b"connection: close" in buf.partition(b"\r\n\r\n")[0].lower():
        t.sock = None
        sock.close()
    return (first - start) * 1000


def summarize(t: Target, baseline_rps: float | None, direct_ttfb: float | None) -> dict[str, Any]:
    reqs = sum(r["requests"] for r in t.rounds)
    secs = sum(r["seconds"] for r in t.rounds)
    rps = reqs / secs if secs else 0.0
    ttfb = statistics.median(t.ttfb_ms) if t.ttfb_ms else None
    return {
        "rps": rps,
        "x_aiohttp": rps / baseline_rps if baseline_rps else None,
        "p50_ms": statistics.median(r["p50_ms"] for r in t.rounds),
        "p99_ms": statistics.median(r["p99_ms"] for r in t.rounds),
        "cpu_us_per_req": sum(r["cpu_s"] for r in t.rounds) / reqs * 1e6 if reqs else None,
        "replica_cpu_us_per_req": (
            sum(r["replica_cpu_s"] for r in t.rounds) / reqs * 1e6 if reqs else None
        ),
        "ttfb_ms": ttfb,
        "ttfb_minus_direct_ms": ttfb - direct_ttfb if ttfb is not None and direct_ttfb else None,
        "errors": sum(r["errors"] + r["non_2xx"] for r in t.rounds),
        "rps_by_round": [round(r["requests"] / r["seconds"], 1) for r in t.rounds],
        "rounds": t.rounds,
        "ttfb_samples_ms": t.ttfb_ms,
    }


def fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None or v != v else format(v, spec)


def table(summary: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| target | req/s | x aiohttp | p50 ms | p99 ms | CPU µs/req | replica CPU µs/req "
        "| TTFB ms | TTFB - direct ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        rows.append(
            f"| {name} | {fmt(s['rps'], ',.0f')} | {fmt(s['x_aiohttp'], '.2f')} "
            f"| {fmt(s['p50_ms'], '.2f')} | {fmt(s['p99_ms'], '.2f')} "
            f"| {fmt(s['cpu_us_per_req'], '.1f')} | {fmt(s['replica_cpu_us_per_req'], '.1f')} "
            f"| {fmt(s['ttfb_ms'], '.3f')} | {fmt(s['ttfb_minus_direct_ms'], '+.3f')} "
            f"| {s['errors']} |"
        )
    return "\n".join(rows)


def machine_info(loadgen: str, threads: int, connections: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadgen": f"wrk -t{threads} -c{connections}" if loadgen == "wrk" else "bench/loadgen.py",
        "pinning": "none: load generator, replicas and target share all CPUs",
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    nginx = find_nginx()
    if nginx:
        v = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
        info["nginx"] = v.split("/")[-1]
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per target per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds per target before round 1")
    p.add_argument("--targets", default=",".join(ALL_TARGETS), help="comma-separated subset")
    p.add_argument("--loadgen", choices=("auto", "wrk", "builtin"), default="auto")
    p.add_argument("--ttfb-samples", type=int, default=50)
    p.add_argument("--ttfb-delay", type=float, default=0.02, help="s between the 2 SSE events")
    p.add_argument("--sluice-args", default="", help="extra sluice-proxy args (shell-quoted)")
    p.add_argument("--request", choices=("get", "chat"), default="get",
                   help="get: 'GET /fast'; chat: a ~2 KB chat-completions-shaped POST /fast "
                        "(16 bodies in turn; needs the built-in load generator)")
    p.add_argument("--json", dest="json_path", help="write all results here")
    p.add_argument("--keep-logs", action="store_true", help="keep the process logs directory")
    args = p.parse_args()
    loadgen = args.loadgen
    if loadgen == "auto":
        loadgen = "wrk" if shutil.which("wrk") and args.request == "get" else "builtin"
    body_file: Path | None = None
    if args.request == "chat":
        fd, name = tempfile.mkstemp(prefix="sluice-bench-bodies-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(chat_bodies(), f)
        body_file = Path(name)

    def run(url: str, duration: float = args.duration) -> dict[str, Any]:
        return run_load(loadgen, url, args.connections, args.threads, duration, body_file)

    # SIGINT and SIGTERM unwind (even if SIGINT was ignored by whoever started us), so the
    # finally below stops every process.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info = machine_info(loadgen, args.threads, args.connections)
    if info["loadavg_1m_at_start"] > 0.5:
        print(f"# warning: load average {info['loadavg_1m_at_start']} at start: "
              "other work on this machine will skew the numbers", file=sys.stderr)  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    procs = Processes(log_dir)
    failed = False
    try:
        replica_ports = [free_port(), free_port()]
        replica_pids = []
        for i, port in enumerate(replica_ports):
            argv = [sys.executable, str(BENCH / "fast_replica.py"), "--port", str(port),
                    "--id", f"r{i}"]  # fmt: skip
            proc = procs.start(f"replica{i}", argv)
            wait_until_up(proc, [(port, "/fast")], within=15)
            replica_pids.append(proc.pid)
        replica_urls = [f"http://{HOST}:{p}" for p in replica_ports]

        targets: list[Target] = []
        skipped: dict[str, str] = {}
        sluice_args = shlex.split(args.sluice_args)
        for name in args.targets.split(","):
            if name == "direct":
                targets.append(Target("direct", replica_ports[0], [replica_pids[0]]))
                continue
            try:
                targets.append(start_target(name, procs, replica_urls, log_dir, sluice_args))
            except (RuntimeError, OSError) as exc:
                skipped[name] = str(exc)
                print(f"# skipping {name}: {exc}", file=sys.stderr)

        for t in targets:  # warm pools and caches; not measured
            if args.warmup > 0:
                run(f"http://{HOST}:{t.port}/fast", args.warmup)
        for rnd in range(args.rounds):
            for t in targets:
                t.rounds.append(measure(t, replica_pids, run))
                r = t.rounds[-1]
                print(f"# round {rnd + 1}/{args.rounds} {t.name}: "
                      f"{r['requests'] / r['seconds']:,.0f} req/s", file=sys.stderr)  # fmt: skip
        for i in range(args.ttfb_samples + 1):
            for t in targets:
                try:
                    ms = ttfb_once(t, args.ttfb_delay)
                except (OSError, ConnectionError) as exc:
                    print(f"# ttfb {t.name}: {exc}", file=sys.stderr)
                    continue
                if i:  # the first sample opens connections on both sides: not counted
                    t.ttfb_ms.append(ms)
        for t in targets:
            if t.sock is not None:
                t.sock.close()

        by_name = {t.name: t for t in targets}
        base = by_name.get("aiohttp")
        base_rps = summarize(base, None, None)["rps"] if base else None
        direct = by_name.get("direct")
        direct_ttfb = statistics.median(direct.ttfb_ms) if direct and direct.ttfb_ms else None
        summary = {t.name: summarize(t, base_rps, direct_ttfb) for t in targets}
        print(
            f"\n{info['cpus']} CPUs, {info['loadgen']}, {args.rounds} rounds x "
            f"{args.duration:g} s per target, interleaved; 100-byte replies from 2 fast "
            f"replicas; no CPU pinning. CPU µs/req: the target's processes (for direct: "
            f"the replica). TTFB: median of {args.ttfb_samples}. Load average at start: "
            f"{info['loadavg_1m_at_start']}.\n"
        )
        print(table(summary))
        for name, why in skipped.items():
            print(f"\n{name}: skipped ({why.splitlines()[0]})")
        if args.json_path:
            doc = {"machine": info, "args": vars(args), "skipped": skipped, "results": summary}
            Path(args.json_path).write_text(json.dumps(doc, indent=2))
    except BaseException:
        failed = True
        raise
    finally:
        procs.stop_all()
        if body_file is not None:
            body_file.unlink()
        if failed or args.keep_logs:
            print(f"# process logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("# interrupted; every process was stopped", file=sys.stderr)
        sys.exit(130)
