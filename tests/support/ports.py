"""Free 127.0.0.1 ports for tests: the one helper every test and fixture uses.

`free_port(count=1)`: the first of `count` consecutive ports that nothing listens on
now and that this process has not handed out before (so two fixtures in one test never
get the same port). A port nothing listens on is also what a test wants for a
"connection refused" address.

Under pytest-xdist (the README's test command runs the suite in worker processes)
each worker hands out ports only from its own blocks of `BLOCK` ports (block number
modulo the worker count): a port one worker found free and is about to listen on is
never the one another worker finds free a moment later. The blocks lie outside the
kernel's ephemeral port range, so no outgoing connection takes such a port as its
local one in between either.
"""

from __future__ import annotations

import os
import random
import socket

HOST = "127.0.0.1"
BLOCK = 16  # ports per block; a `count` never spans two blocks
FLOOR = 10240  # the lowest port handed out (a port something listens on is skipped)

_handed_out: set[int] = set()


def _share() -> tuple[int, int]:
    """(this worker's index, the number of workers); (0, 1) outside pytest-xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def free_port(count: int = 1) -> int:
    """A port on 127.0.0.1 (the first of ``count`` consecutive ones) that nothing listens on
    now, that this process has not handed out before and, under pytest-xdist, that lies in
    this worker's blocks."""
    if not 1 <= count <= BLOCK:
        raise ValueError(f"count must be 1..{BLOCK}, got {count}")
    index, workers = _share()
    for _ in range(2000):
        # A random place in one of this worker's blocks, outside the ephemeral range
        # (`_blocks`; not bind(0) either: Linux hands those out odd-numbered only).
        block = random.randrange(*_BLOCKS)
        block += (index - block) % workers
        port = block * BLOCK + random.randrange(BLOCK - count + 1)
        ports = range(port, port + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return port
    raise RuntimeError("no free port found")


def _blocks() -> tuple[int, int]:
    """The blocks to hand out: below the kernel's ephemeral port range (or above it,
    whichever holds more), with room for a worker's offset at the top. Never inside it:
    the kernel gives connect()ing sockets their local ports from that range, and a
    listener cannot bind a port an outgoing connection holds (seen in CI: "address
    already in use" for a port found free a moment before). Inside it only when the
    range leaves fewer than 256 blocks outside."""
    lo, hi = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        pass
    below = (-(-FLOOR // BLOCK), lo // BLOCK - 64)
    above = (-(-(hi + 1) // BLOCK), 65536 // BLOCK - 64)
    best = max(below, above, key=lambda b: b[1] - b[0])
    if best[1] - best[0] >= 256:
        return best
    return -(-lo // BLOCK), hi // BLOCK - 64


_BLOCKS = _blocks()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True
