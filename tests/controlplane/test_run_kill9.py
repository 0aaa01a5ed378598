"""`kill -9` of `sluice run`, of its controller or of its proxy leaves no replica and
no redis-server running. A real `sluice run` of a tiny local-replica service; and a
controller closing with its Redis already gone (in process).

Replicas are found by a marker in their environment (the spec's `envs`), scanning
/proc: whatever launched them and whatever the records say, none may survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane import ops, processes
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.redisserver import EmbeddedRedis
from controlplane.store import Store, StoreUnavailable
from tests.support.builders import make_spec, pid_of, ready_view
from tests.support.cli import spawn_sluice
from tests.support.pids import running
from tests.support.poll import until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO

SETTLE = 90.0  # bound for everything to be gone after the kill (a busy 2-core box)


def marked(marker: str) -> list[int]:
    """Pids of live processes whose environment carries `marker`."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                if processes.running(int(entry)):
                    found.append(int(entry))
    return found


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def survivors(marker: str, started: dict[str, tuple[int, int | None]]) -> list[str]:
    """What outlived a kill -9, each as `role-or-pid: command line`, for the failure."""
    roles = {pid: role for role, (pid, start) in started.items() if processes.running(pid, start)}
    out = []
    for pid in sorted(set(marked(marker)) | set(roles)):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out.append(f"{roles.get(pid, pid)} (pid {pid}): {argv.strip()}")
    return out


def write_spec(path: Path, marker: str, *, setup: bool) -> None:
    run = f"exec {sys.executable} -m tests.support.replica_app --port $PORT --id $SLUICE_REPLICA_ID"
    key, value = marker.split("=", 1)
    path.write_text(
        # A setup that never ends: bash and its child sleep, one process group.
        ("setup: sleep 300; true\n" if setup else "") +
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    endpoint_probe_interval_seconds: 0.5\n"
        "  replicas: 2\n"
        f"workdir: {REPO}\n"
        f"envs:\n  {key}: {value}\n"
        f"run: {run}\n"
    )


@contextlib.contextmanager
def sluice_run(spec: Path, state: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    argv = ["run", str(spec), "-n", "k9", "--state-dir", str(state), "--host", HOST,
            "--port", str(free_port()), "--drain-seconds", "0", "--down-timeout", "30"]  # fmt: skip
    proc = spawn_sluice(argv, log)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def wait_for(predicate: Callable[[], object], within: float, what: str, log: Path) -> None:
    """`until_sync`, with the run's log in the failure."""
    try:
        until_sync(predicate, timeout=within, what=what, interval=0.05)
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{log.read_text()}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("victim", "setup"),
    # `run` failed in 2 of 4 full runs before 626bf33 (a replica committed just before
    # Redis died outlived the kill); it passed in every full run since (16, CI included).
    [("run", False), ("controller", False), ("proxy", False), ("run", True),
     ("controller", True)],
    ids=["run", "controller", "proxy", "run-during-setup", "controller-during-setup"],
)  # fmt: skip
def test_kill_9_leaves_no_replica_and_no_redis_running(
    victim: str, setup: bool, tmp_path: Path
) -> None:
    marker = f"SLUICE_KILL9_TEST={uuid.uuid4().hex}"
    spec, state, log = tmp_path / "svc.yaml", tmp_path / "state", tmp_path / "run.log"
    write_spec(spec, marker, setup=setup)
    started: dict[str, tuple[int, int | None]] = {}  # role -> (pid, start time)
    try:
        with sluice_run(spec, state, log) as run:

            def up() -> bool:
                assert run.poll() is None, f"sluice run exited:\n{log.read_text()}"
                with contextlib.suppress(OSError, ValueError):
                    pids = json.loads((state / "run.json").read_text())["pids"]
                    if set(pids) != {"redis", "controller", "proxy"}:
                        return False
                    if setup:  # the setup runs: bash and its child sleep
                        return any(_comm(pid) == "sleep" for pid in marked(marker))
                    return len(marked(marker)) == 2
                return False

            wait_for(up, 60, "sluice run to start its replicas (or setup)", log)
            if setup:
                # Its handle file follows the spawn by microseconds; no need to fail here
                # if it never comes (that is what the assertion below catches).
                with contextlib.suppress(AssertionError):
                    until_sync((state / "k9" / "setup-v1.json").exists, timeout=5)
                setup_handle = state / "k9" / "setup-v1.json"
                if setup_handle.exists():  # private like every state file
                    assert setup_handle.stat().st_mode & 0o777 == 0o600
            pids = json.loads((state / "run.json").read_text())["pids"]
            started = {role: (pid, processes.start_time(pid)) for role, pid in pids.items()}
            started["run"] = (run.pid, processes.start_time(run.pid))
            for i, pid in enumerate(marked(marker)):
                started[f"replica{i}"] = (pid, processes.start_time(pid))

            os.kill(started[victim][0], signal.SIGKILL)

            def all_gone() -> bool:
                run.poll()  # reap sluice run itself if it ended
                return not marked(marker) and not any(
                    processes.running(pid, start) for pid, start in started.values()
                )

            try:
                until_sync(all_gone, timeout=SETTLE, interval=0.05)
            except AssertionError:
                pytest.fail(f"after kill -9 of the {victim}, still running: "
                            f"{survivors(marker, started)}\n{log.read_text()}")  # fmt: skip
    finally:
        for pid in marked(marker):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for pid, start in started.values():
            if processes.running(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def exit_config(server: EmbeddedRedis, tmp_path: Path) -> ControllerConfig:
    """A controller as `sluice run` starts it: it terminates its replicas on exit."""
    return ControllerConfig(
        redis_url=server.url, state_dir=tmp_path / "state", reconcile_interval=30.0,
        term_timeout=3.0, terminate_on_exit=True,
    )  # fmt: skip


async def run_then_close(
    controller: Controller,
    work: Callable[[], Awaitable[list[int]]],
    before_close: Callable[[], None] = lambda: None,
) -> None:
    """Start `controller`, run `work()` (it returns the replicas' pids) beside its run(),
    cancel the run, call `before_close`, then close the controller: none of the pids may
    outlive that (they are SIGKILLed at the end either way)."""
    await controller.start()
    runner = asyncio.create_task(controller.run())
    pids: list[int] = []
    try:
        pids = await work()
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    try:
        before_close()
        await controller.aclose()
        assert not [pid for pid in pids if running(pid)]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


async def test_terminate_on_exit_stops_the_replicas_when_redis_is_gone(
    redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path
) -> None:
    # What a controller under `sluice run` does when `sluice run` dies: its private
    # Redis gets SIGTERM at the same moment, so the controller may close without it.
    server = redis_factory()
    async with Store.from_url(server.url) as store:

        async def serve_two() -> list[int]:
            await ops.up(store, "svc", make_spec(2))
            await ready_view(store, "svc", 2)
            return [pid_of(r) for r in (await store.replicas("svc")).values()]

        controller = Controller(store, exit_config(server, tmp_path))
        await run_then_close(controller, serve_two, before_close=server.kill)


async def test_a_replica_committed_just_before_redis_dies_is_still_terminated(
    redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path
) -> None:
    # `sluice run` killed just after its controller recorded the replicas' processes:
    # its Redis dies before the rest of that step (the event writes) can run. The
    # committed replicas are no launch in flight any more; the controller must still
    # know them, or the terminate-on-exit below (Redis gone) leaves them running.
    server = redis_factory()
    async with Store.from_url(server.url) as store:
        controller = Controller(store, exit_config(server, tmp_path))
        after_commit = controller._after_commit
        crashed = asyncio.Event()

        async def redis_dies_after_the_commit(plan: Any, launched: Any) -> None:
            await after_commit(plan, launched)
            if plan.done_launches:  # this commit recorded processes
                server.kill()
                crashed.set()
                raise StoreUnavailable("Redis died (the test killed it)")

        async def until_redis_died() -> list[int]:
            await ops.up(store, "svc", make_spec(2))
            await asyncio.wait_for(crashed.wait(), 30)
            pids = [pid for pid in _handle_pids(tmp_path / "state") if running(pid)]
            assert pids, "no replica process was started"
            return pids

        controller._after_commit = redis_dies_after_the_commit  # type: ignore[method-assign]
        await run_then_close(controller, until_redis_died)


def _handle_pids(state: Path) -> list[int]:
    """The pids in the local backend's replica handle files under `state`."""
    pids = []
    for path in state.rglob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pids.append(int(json.loads(path.read_text())["pid"]))
    return pids
