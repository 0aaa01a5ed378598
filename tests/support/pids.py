"""The processes a test started, read from Linux /proc: their descendants, whether each
still runs, and SIGKILL for what is left (by pid, never by name); and, for the benches,
SIGTERM made an interrupt so that a bench stopped by `kill` stops what it started."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable


def descendants(pid: int) -> list[int]:
    """Direct and indirect children of pid (Linux /proc), so workers die with their master."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (orphans may wait for a reaper that never comes)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each of `pids` that still runs (processes this test started)."""
    for pid in pids:
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does.

    By default SIGTERM ends Python at once, skipping `finally` blocks and context exits: a
    bench stopped by `kill` left its replicas, proxies, redis-servers or llama-servers
    running (four llama-servers at a core each, from bench/real_engines.py). As an
    interrupt, the bench's own cleanup stops them."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
