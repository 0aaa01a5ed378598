"""The local backend: each replica is a process group on this machine.

Ports: each replica gets a free 127.0.0.1 port in `PORT`, unless its spec has a
fixed port (`fixedport.py`: the run command spells out the spec's port and does not
use `$PORT`); that replica is run with `PORT` set to the fixed port.

Per version, the task's `setup` runs once (`bash -c`, in `workdir`, logged to
`{state_dir}/{service}/setup-v{version}.log`; a marker file keyed by the spec's
task fields keeps it from running twice, across controller restarts too). Per
replica, the task's `run` command runs as `bash -c` in its own session and
process group, in `workdir`, with a clean environment: the host variables named
by `HOST_ENV_NAMES` / `HOST_ENV_PREFIXES` (PATH, HOME, LANG, CUDA_* ...; never a
SLUICE_* variable, so never the controller's Redis URL and password), then the
spec's `envs` and `secrets`, then `PORT` (a free 127.0.0.1 port),
`SLUICE_REPLICA_ID` and `SKYPILOT_SERVE_REPLICA_ID`; stdout and stderr go to
`{state_dir}/{service}/replica-{id}.log`. Setup gets the same environment
without the three replica variables. The service directory is 0700, its logs
and handle files 0600; an invalid service name (from a hand-written Redis key)
fails the launch before any path is made from it.
A running setup has a handle file too (`setup-v{version}.json`, removed when it
ends).

The handle records pid (= process group id), the process's start time (so a
recycled pid is never mistaken for the replica), port and log path; it is also
written to `replica-{id}.json` right after the spawn, so a controller that dies
between spawning and recording the replica leaves it recoverable. Processes are
spawned with posix_spawn and reaped by pid: a replica outlives the controller
that started it, and the next controller adopts it by pid.

Terminate: SIGTERM to the group; SIGKILL to the group after `term_timeout`. Only
while the group can be the replica's (`processes.owns_group`): a pid that now
belongs to another process (its start time differs) is never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from controlplane import processes
from controlplane.backends.base import Launched, LaunchFailed, TaskFailed
from controlplane.backends.fixedport import bindable, fixed_port
from controlplane.backends.localproc import POLL, describe_status, handle_pid
from controlplane.records import Handle, InvalidServiceName, check_service_name
from controlplane.servicespec import ServiceSpec
from controlplane.statedir import (
    FILE_MODE,
    StateDir,
    handle_file_of,
    open_private_append,
    private_dir,
    write_private,
)

log = logging.getLogger("sluice.backend.local")

HOST = "127.0.0.1"
# Runs the task in its workdir; `exec` keeps the pid, so pid == process group id.
_LAUNCHER = 'cd -- "$0" || exit 97; exec bash -c "$1"'
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND

#: Host variables a replica inherits (docs/security.md): where programs and libraries
#: are, locale and time zone, the user, the GPU runtime's own settings. Anything else
#: (cloud keys, tokens, SLUICE_REDIS_URL) reaches a replica only through the spec's
#: `envs`/`secrets`.
HOST_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
    "HOSTNAME", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR",
})  # fmt: skip
HOST_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "HIP_", "ROCR_", "XDG_")


def replica_host_env(host: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of the host environment `host`."""
    return {
        name: value
        for name, value in host.items()
        if name in HOST_ENV_NAMES or name.startswith(HOST_ENV_PREFIXES)
    }


class LocalBackend:
    """Replicas as local process groups; see the module docstring."""

    name = "local"
    can_launch = True

    def __init__(
        self,
        state_dir: Path,
        *,
        base_env: Mapping[str, str] | None = None,
        base_dir: Path | None = None,
        term_timeout: float = processes.TERM_TIMEOUT,
    ) -> None:
        """`base_env`: the host environment whose allow-listed variables replicas get
        (default: this process's, read now); `base_dir`: what a relative `workdir` is
        relative to (default: the cwd)."""
        self._layout = StateDir(state_dir)
        self._base_env = replica_host_env(os.environ if base_env is None else base_env)
        self._base_dir = base_dir if base_dir is not None else Path.cwd()
        self._term_timeout = term_timeout
        self._children: set[int] = set()  # pids we spawned and have not reaped
        self._exit_codes: dict[int, int] = {}  # reaped pid -> exit status
        self._setups: dict[str, asyncio.Task[None]] = {}
        self._bash = shutil.which("bash", path=self._base_env.get("PATH")) or "/bin/bash"

    async def start(self) -> None:
        """Nothing to acquire: directories are made per service on launch."""

    async def aclose(self) -> None:
        """Cancel running setups (their process groups are killed). Replicas keep running."""
        tasks = list(self._setups.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:  # retrieved: a failed setup was reported to its launches
            if not task.cancelled():
                task.exception()
        self._setups.clear()

    # -- launch ------------------------------------------------------------------------------

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec
    ) -> Launched:
        """Run setup (once per version), then spawn `run`. Raises LaunchFailed."""
        if not spec.run or spec.num_nodes > 1:  # `up` refuses these (backends.fit)
            # The spec, not the machine: retrying cannot help, so it gives up the version.
            raise TaskFailed("the spec has no `run` command" if not spec.run else
                             f"num_nodes: {spec.num_nodes}; a local replica is one process")
        self._service_dir(service)
        workdir = self._workdir(spec)
        env = self._env(spec)
        if spec.setup:
            await self._setup(service, version, spec, workdir, env)
        port = fixed_port(spec)
        if port is None:
            port = processes.free_port(HOST)
        elif not bindable(port):
            raise TaskFailed(
                f"port {port} (service.ports; the run command does not use $PORT) is in use"
            )
        log_path = self._layout.replica_log(service, replica_id)
        env.update(
            PORT=str(port),
            SLUICE_REPLICA_ID=str(replica_id),
            SKYPILOT_SERVE_REPLICA_ID=str(replica_id),
        )
        pid = self._spawn([self._bash, "-c", _LAUNCHER, str(workdir), spec.run], env, log_path)
        handle: Handle = {
            "pid": pid,
            "start_time": processes.start_time(pid),
            "port": port,
            "log": str(log_path),
        }
        # Written before the controller records the replica: if it dies in between,
        # its successor finds the process here (`recover`).
        write_private(self._handle_path(service, replica_id), json.dumps(handle).encode())
        log.info("service %s: replica %d (v%d) pid %d on port %d", service, replica_id,
                 version, pid, port)  # fmt: skip
        return Launched(url=f"http://{HOST}:{port}", handle=handle)

    def recover(self, service: str, replica_id: int) -> Launched | None:
        """The replica from its handle file, if its process still runs."""
        try:
            handle: Handle = json.loads(self._handle_path(service, replica_id).read_text())
        except (OSError, ValueError):
            return None
        if self.exited(handle) is not None:
            return None
        return Launched(url=f"http://{HOST}:{handle['port']}", handle=handle)

    # -- liveness and termination ------------------------------------------------------------

    def exited(self, handle: Handle) -> str | None:
        """None while the replica's process runs; otherwise how it ended."""
        pid = handle_pid(handle)
        if pid is None:
            return "no process recorded"
        self._reap(pid)
        if pid in self._exit_codes:
            return describe_status(self._exit_codes[pid])
        if not processes.running(pid, handle.get("start_time")):
            # It may have exited between the two looks (a zombie now): its status first.
            self._reap(pid)
            if pid in self._exit_codes:
                return describe_status(self._exit_codes[pid])
            return f"process {pid} is gone"
        return None

    async def terminate(self, handle: Handle) -> None:
        """SIGTERM the process group, SIGKILL it after `term_timeout`; remove the handle file."""
        pid = handle_pid(handle)
        if pid is not None:
            self._reap(pid)  # our own exited child: its pid is free, not a stranger's
        if pid is not None and not processes.owns_group(pid, handle.get("start_time")):
            # The pid belongs to another process now (or cannot be verified): its group
            # is a stranger's. Never signal it.
            log.warning("replica process %d is not the one recorded (start time differs); "
                        "not signalling it", pid)  # fmt: skip
            pid = None
        if pid is not None and self.exited(handle) is None:
            processes.signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + self._term_timeout
            while self.exited(handle) is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(POLL)  # nothing to await: the process may not be ours
        if pid is not None and processes.owns_group(pid, handle.get("start_time")):
            # Stragglers the leader left behind, or a leader that ignored SIGTERM.
            processes.signal_group(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while self.exited(handle) is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(POLL)  # nothing to await: the process may not be ours
        if pid is not None:
            self._exit_codes.pop(pid, None)  # gone for good: `exited` still says so (/proc)
        log_path = handle.get("log")
        if isinstance(log_path, str):
            with contextlib.suppress(OSError):
                handle_file_of(Path(log_path)).unlink()

    # -- internals ---------------------------------------------------------------------------

    def _service_dir(self, service: str) -> Path:
        try:
            check_service_name(service)
        except InvalidServiceName as exc:
            raise LaunchFailed(str(exc)) from exc
        return private_dir(self._layout.service_dir(service))

    def _handle_path(self, service: str, replica_id: int) -> Path:
        return self._layout.replica_handle(check_service_name(service), replica_id)

    def _workdir(self, spec: ServiceSpec) -> Path:
        workdir = self._base_dir / spec.workdir if spec.workdir else self._base_dir
        if not workdir.is_dir():
            raise TaskFailed(f"workdir {str(workdir)!r} is not a directory")
        return workdir

    def _env(self, spec: ServiceSpec) -> dict[str, str]:
        return {**self._base_env, **spec.envs, **spec.secrets}

    def _spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> int:
        try:
            pid = os.posix_spawn(
                argv[0],
                argv,
                env,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, str(log_path), _APPEND, FILE_MODE),
                    (os.POSIX_SPAWN_DUP2, 1, 2),
                ],
                setsid=True,  # own session and process group: pgid == pid
            )
        except OSError as exc:
            raise LaunchFailed(f"could not start {argv[0]}: {exc}") from exc
        self._children.add(pid)
        return pid

    def _reap(self, pid: int) -> None:
        if pid not in self._children:
            return
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            self._children.discard(pid)
            return
        if done:
            self._children.discard(pid)
            self._exit_codes[pid] = status

    async def _setup(
        self, service: str, version: int, spec: ServiceSpec, workdir: Path, env: dict[str, str]
    ) -> None:
        key = _task_digest(spec, workdir)
        self._service_dir(service)
        marker = self._layout.setup_marker(service, version, key)
        if marker.exists():
            return
        task = self._setups.get(marker.name)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.create_task(self._run_setup(service, version, spec, workdir, env))
            self._setups[marker.name] = task
        await asyncio.shield(task)
        marker.touch(mode=FILE_MODE)

    async def _run_setup(
        self, service: str, version: int, spec: ServiceSpec, workdir: Path, env: dict[str, str]
    ) -> None:
        self._service_dir(service)
        log_path = self._layout.setup_log(service, version)
        assert spec.setup is not None
        with os.fdopen(open_private_append(log_path), "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                self._bash, "-c", spec.setup, cwd=workdir, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        # Like a replica's handle file: lets `sluice run` stop a setup whose controller died.
        handle_path = self._layout.setup_handle(service, version)
        write_private(handle_path, json.dumps(
            {"pid": proc.pid, "start_time": processes.start_time(proc.pid)}
        ).encode())  # fmt: skip
        try:
            code = await proc.wait()
        except asyncio.CancelledError:
            processes.signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        finally:
            with contextlib.suppress(OSError):
                handle_path.unlink()
        if code != 0:
            raise TaskFailed(f"setup of version {version} exited with code {code} "
                               f"(see {log_path})")  # fmt: skip


def _task_digest(spec: ServiceSpec, workdir: Path) -> str:
    """Identifies what setup depends on, so a changed task runs its own setup."""
    material = json.dumps(
        [spec.setup, str(workdir), sorted(spec.envs.items()), sorted(spec.secrets.items())]
    )
    return hashlib.sha256(material.encode()).hexdigest()[:12]
