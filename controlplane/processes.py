"""Child processes of the control plane (replicas, redis-server, the controller and
proxy under `sluice run`): free ports, process identity, signals.

A pid alone is not an identity: pids are recycled. A process is identified by
its pid and its start time (field 22 of /proc/PID/stat), so a controller that
adopts replicas, or `sluice run` cleaning up, never signals a stranger.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable

#: Seconds from SIGTERM to SIGKILL when stopping a local replica's process group.
TERM_TIMEOUT = 10.0

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/{pid}/stat after the command name (state is [0], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def running(pid: int, started: object = None) -> bool:
    """True if `pid` is a live (not zombie) process started at `started` (when given)."""
    fields = stat_fields(pid)
    if fields is None:
        if not os.path.isdir("/proc/self"):  # no procfs: fall back to a signal probe
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    if fields[0] in ("Z", "X"):
        return False
    if isinstance(started, int) and len(fields) > 19 and int(fields[19]) != started:
        return False  # the pid was recycled
    return True


def owns_group(pid: int, started: object) -> bool:
    """True if signalling process group `pid` can only reach the process started at
    `started` (and its group): that process still runs with that start time, or no
    process has the pid any more (Linux does not reuse a pid while a group of that id
    has members, so group `pid` can then only hold the original's stragglers).

    False when the pid now belongs to another process (recycled, e.g. after a host
    reboot with the records kept), or when the start time is unknown and the pid is
    alive: that group may be a stranger's.
    """
    if not os.path.isdir("/proc/self"):
        return True  # no procfs (not Linux): start times are neither recorded nor checkable
    fields = stat_fields(pid)
    if fields is None:
        return True
    if not isinstance(started, int) or isinstance(started, bool):
        return False
    return len(fields) > 19 and int(fields[19]) == started


def signal_group(pgid: int, sig: int) -> None:
    """Signal a process group, ignoring one that is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn giving the child SIGTERM when the parent thread dies (Linux only)."""
    if sys.platform != "linux":
        return None
    try:
        # Resolved here, in the parent: the child must not dlopen between fork and exec.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook
