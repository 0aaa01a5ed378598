"""Signals never reach a stranger: a replica record whose pid now belongs to another
process (pid recycled, e.g. after a host reboot with the Redis data kept) is not
signalled, neither the pid nor its process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from controlplane import processes
from controlplane.backends.local import LocalBackend
from controlplane.records import Handle
from controlplane.run import RunConfig, ServiceRun
from controlplane.servicespec import load_spec
from tests.support.pids import running
from tests.support.poll import until
from tests.support.processes import REPO

ECHO = REPO / "examples" / "echo.yaml"


async def test_terminate_leaves_a_stranger_with_another_start_time_alive(
    tmp_path: Path,
) -> None:
    # A process that is its own session and group leader, as a replica is (pgid == pid).
    stranger = subprocess.Popen(["setsid", "sleep", "300"])
    try:
        started = processes.start_time(stranger.pid)
        assert started is not None
        await until(lambda: os.getpgid(stranger.pid) == stranger.pid, what="setsid")
        handle: Handle = {
            "pid": stranger.pid,
            "start_time": started - 1,  # the replica that once had this pid
            "port": 9,
            "log": str(tmp_path / "svc" / "replica-1.log"),
        }
        backend = LocalBackend(tmp_path, term_timeout=0.2)
        assert backend.exited(handle) is not None  # not the replica: it is gone
        await backend.terminate(handle)
        assert running(stranger.pid)
        assert stranger.poll() is None

        # Without a recorded start time the pid cannot be verified: not signalled either.
        await backend.terminate({"pid": stranger.pid, "port": 9})
        assert stranger.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stranger.pid, signal.SIGKILL)
        stranger.wait(10)


async def test_terminate_still_kills_the_recorded_group(tmp_path: Path) -> None:
    # The real replica (start time matches), ignoring SIGTERM, with a child in its group
    # (SIG_IGN is inherited): both SIGKILLed.
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        ["bash", "-c", f"trap '' TERM; sleep 300 & echo $! > {ready}; wait"],
        start_new_session=True,
    )
    try:
        await until(lambda: ready.exists() and ready.read_text().strip(), what="child")
        child = int(ready.read_text())
        handle: Handle = {"pid": proc.pid, "start_time": processes.start_time(proc.pid)}
        backend = LocalBackend(tmp_path, term_timeout=0.2)
        await backend.terminate(handle)
        assert proc.wait(10) == -signal.SIGKILL
        await until(lambda: not running(child), what="the group's other process to die")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def test_sluice_run_cleanup_leaves_a_stranger_alive(tmp_path: Path) -> None:
    # A handle file left by an earlier run whose pid now belongs to a stranger; one with
    # the wrong start time, one with none (cannot be verified).
    stranger = subprocess.Popen(["setsid", "sleep", "300"])
    try:
        await until(lambda: os.getpgid(stranger.pid) == stranger.pid, what="setsid")
        started = processes.start_time(stranger.pid)
        assert started is not None
        service_dir = tmp_path / "svc"
        service_dir.mkdir()
        (service_dir / "replica-1.json").write_text(
            json.dumps({"pid": stranger.pid, "start_time": started + 1})
        )
        (service_dir / "replica-2.json").write_text(json.dumps({"pid": stranger.pid}))
        run = ServiceRun(
            RunConfig(spec=load_spec(ECHO), name="svc", state_dir=tmp_path, stop_timeout=0.2)
        )
        run._kill_replicas()
        assert stranger.poll() is None
        assert running(stranger.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stranger.pid, signal.SIGKILL)
        stranger.wait(10)
