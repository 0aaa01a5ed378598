"""What watching a stream for resumption costs: sluice-proxy CPU per streamed event,
with --resume-streams off and on, interleaved.

Starts one replica (tests/support/vllm_fake.py with no delay between tokens: a fake
of vLLM's API that streams a chat answer as fast as it can) and, per round, a
sluice-proxy without and one with `--resume-streams` in front of it; sends
`--streams` streamed chat completions of `--tokens` tokens through each, one after
the other, and reads the proxy's CPU time (/proc) around them. Nothing is killed:
this is the price of the common path of a resumable stream (whole events only,
the relayed bytes kept), not of a resume. Prints a markdown table of every round
and the median. 127.0.0.1 only; every process is stopped by pid at the end.

    python bench/resume_cost.py [--rounds 3] [--streams 40] [--tokens 400]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench.proxy_overhead import Processes, cpu_seconds, wait_until_up  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

HOST = "127.0.0.1"


def stream_once(port: int, tokens: int) -> int:
    """One streamed chat completion read to its end; returns the events received."""
    body = json.dumps({"model": "m", "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "bench"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    data = bytearray()
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(head + body)
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), bytes(data[:80])
    assert b"data: [DONE]" in data and data.endswith(b"0\r\n\r\n"), "stream cut"
    return data.count(b"data: ")


def measure(proc_pid: int, port: int, streams: int, tokens: int) -> tuple[float, float]:
    """(proxy CPU µs per event, wall seconds) for `streams` streams."""
    stream_once(port, tokens)  # warm the pool
    cpu0, t0 = cpu_seconds([proc_pid]), time.monotonic()
    events = sum(stream_once(port, tokens) for _ in range(streams))
    return (cpu_seconds([proc_pid]) - cpu0) / events * 1e6, time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--tokens", type=int, default=400)
    args = p.parse_args()
    procs = Processes(Path(tempfile.mkdtemp(prefix="sluice-resume-bench-")))
    rows: dict[str, list[float]] = {"off": [], "on": []}
    try:
        rport = free_port()
        replica = procs.start("replica", [sys.executable, "-m", "tests.support.vllm_fake",
                                          "--port", str(rport), "--token-delay", "0"])
        wait_until_up(replica, [(rport, "/health")], 15)
        proxies = {}
        for mode, extra in (("off", []), ("on", ["--resume-streams"])):
            port, admin = free_port(), free_port()
            proxies[mode] = (procs.start(f"proxy-{mode}", [
                sys.executable, "-m", "proxy.cli", "--host", HOST, "--port", str(port),
                "--admin-port", str(admin), "--replicas", f"http://{HOST}:{rport}",
                "--log-level", "WARNING", *extra]), port, admin)
        for proc, _, admin in proxies.values():
            wait_until_up(proc, [(admin, "/readyz")], 20)
        for r in range(args.rounds):
            for mode, (proc, port, _) in proxies.items():
                cost, wall = measure(proc.pid, port, args.streams, args.tokens)
                rows[mode].append(cost)
                print(f"# round {r + 1} resume {mode}: {cost:.2f} µs/event ({wall:.1f} s)",
                      file=sys.stderr, flush=True)
    finally:
        procs.stop_all()
    print(f"\n{args.streams} streams x {args.tokens} tokens per round, {args.rounds} rounds, "
          "interleaved; proxy CPU (user+sys) per SSE event relayed.\n")
    print("| --resume-streams | " + " | ".join(f"round {i + 1}" for i in range(args.rounds))
          + " | median |")
    print("|---|" + "---:|" * (args.rounds + 1))
    for mode, costs in rows.items():
        print(f"| {mode} | " + " | ".join(f"{c:.2f}" for c in costs)
              + f" | {statistics.median(costs):.2f} |")


if __name__ == "__main__":
    main()
