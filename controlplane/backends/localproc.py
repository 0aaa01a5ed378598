"""A local replica's process group, found from its handle: alive or not, signalled
only while it can be the replica's, and stopped as a last resort.

A handle (what the local backend records: pid = process group id, the process's
start time, port, log) identifies a process by pid and start time, so a recycled
pid is never mistaken for the replica (`processes.owns_group`). The local backend
terminates one replica at a time with these; `sluice run` uses `stop_groups` on
whatever its controller left running, from Redis and from the handle files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from controlplane import processes
from controlplane.records import Handle
from controlplane.statedir import StateDir

POLL = 0.05  # how often a stopping process group is looked at


def handle_pid(handle: Handle) -> int | None:
    """The handle's pid (= its process group), or None when it records none."""
    pid = handle.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def group_running(handle: Handle) -> bool:
    """True if the handle's process runs and is the one the backend started."""
    pid = handle_pid(handle)
    return pid is not None and processes.running(pid, handle.get("start_time"))


def signal_group(handle: Handle, sig: int) -> None:
    """Signal the handle's process group while its leader is the one recorded."""
    pid = handle_pid(handle)
    if (
        pid is not None
        and group_running(handle)
        and processes.owns_group(pid, handle.get("start_time"))  # never a stranger's group
    ):
        processes.signal_group(pid, sig)  # the local backend's replica: pid == its group


def stop_groups(handles: Iterable[Handle], *, timeout: float) -> bool:
    """SIGTERM, then SIGKILL after `timeout`, the process group of every handle whose
    process still runs (pid and start time must match). Blocks. True if there was any."""
    alive = [h for h in handles if group_running(h)]
    for handle in alive:
        signal_group(handle, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(group_running(h) for h in alive) and time.monotonic() < deadline:
        time.sleep(POLL)
    for handle in alive:
        signal_group(handle, signal.SIGKILL)
    return bool(alive)


def recorded_handles(state_dir: Path, service: str) -> list[Handle]:
    """The handles of `service`'s replicas and setups that have a handle file (spawned and
    not yet terminated or finished), for `sluice run`'s last-resort cleanup."""
    handles: list[Handle] = []
    for path in StateDir(state_dir).handle_files(service):
        with contextlib.suppress(OSError, ValueError):
            handle = json.loads(path.read_text())
            if isinstance(handle, dict):
                handles.append(handle)
    return handles


def describe_status(status: int) -> str:
    """How a reaped process ended, from its wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by {name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"
