"""`sluice run FILE`: one service and everything it needs, in the foreground.

`ServiceRun.run()` starts, in order:

1. a private redis-server (`controlplane.redisserver.EmbeddedRedis`, state in
   `{state_dir}/redis`) unless a Redis URL is given;
2. the controller, `python -m controlplane.cli controller ...`, logging to
   `{state_dir}/controller.log`;
3. the proxy, `python -m proxy.cli --redis URL --service NAME ...`, logging to
   `{state_dir}/{name}/proxy.log`;
4. `ops.up` of the service; the controller launches the replicas;

then shows them coming up (a table redrawn in place on a terminal, one line per
change otherwise) until SIGINT, SIGTERM or SIGHUP. Shutdown, in order: `ops.down`;
wait (at most `down_timeout`) for the controller to terminate the replicas and
unregister the service; stop the proxy, then the controller (SIGTERM, SIGKILL
after `stop_timeout`); kill any replica process group still alive (a controller
that missed the deadline, or died; handles from Redis and from the local
backend's handle files, identified by pid and start time); stop redis. A
second signal skips the waiting. Nothing is left running.

Children run in their own sessions, so a Ctrl-C on the terminal reaches only
this process, which then stops them in the order above; each also gets SIGTERM
if this process dies (Linux PR_SET_PDEATHSIG).

`{state_dir}/run.json` (a `RunInfo`) says where this run's Redis is and which
pids it started; the ops commands read it to find Redis when no `--redis` is
given. One `sluice run` per state dir.

Secrets: the private redis-server gets a random password (and listens on
127.0.0.1 only). The password is kept in `{state_dir}/redis/password` (0600, in
a 0700 directory; so is a password given in `--redis`); run.json holds the URL
without it and the path of that file. The controller and the proxy get the URL
in their environment (SLUICE_REDIS_URL), never in argv; their logs are 0600.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

import msgspec

from controlplane import ops, processes
from controlplane.backends.local import check_fixed_port, fixed_port, recorded_handles
from controlplane.display import LiveView
from controlplane.records import Handle, ReplicaRecord, check_service_name
from controlplane.redisserver import EmbeddedRedis
from controlplane.spec import ServiceSpec
from controlplane.statedir import (
    open_private_append,
    private_dir,
    read_secret,
    redact_url,
    split_password,
    with_password,
    write_private,
)
from controlplane.states import ServiceStatus
from controlplane.store import (
    ServiceExists,
    ServiceNotFound,
    Store,
    StoreError,
    StoreUnavailable,
)
from proxy.wire.errors import SluiceError

log = logging.getLogger("sluice.run")

_POLL = 0.05  # how often a stopping child is checked


class RunError(SluiceError):
    """`sluice run` could not start, or a process it started died under it."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything `sluice run` needs; built by the CLI."""

    spec: ServiceSpec
    name: str
    state_dir: Path
    redis_url: str | None = None  # None: start a private redis-server
    redis_ca_file: str | None = None  # the CA of a rediss:// server (None: the system's)
    prefix: str = "sluice"
    host: str = "0.0.0.0"  # the proxy's listen address
    port: int = 8080  # the proxy's port; 0 picks a free one
    admin_port: int = 0  # the proxy's admin port; 0 picks a free one
    drain_seconds: float = 5.0  # the controller's drain delay
    down_timeout: float = 60.0  # how long shutdown waits for the replicas to be terminated
    stop_timeout: float = 10.0  # SIGTERM -> SIGKILL, per process
    startup_timeout: float = 30.0  # for the proxy to listen
    refresh: float = 0.5  # seconds between status refreshes
    log_level: str = "INFO"
    backend: str = "local"  # what the controller launches replicas with: local | skypilot


class RunInfo(msgspec.Struct, kw_only=True):
    """`{state_dir}/run.json`: a running `sluice run`, for the other commands and tests."""

    pid: int
    service: str
    redis_url: str  # without its password
    prefix: str
    endpoint: str
    started_at: float
    pids: dict[str, int] = {}  # redis, controller, proxy
    redis_password_file: str | None = None  # 0600 file holding the password, if any
    redis_ca_file: str | None = None


def run_info_path(state_dir: Path) -> Path:
    return state_dir / "run.json"


def password_path(state_dir: Path) -> Path:
    return state_dir / "redis" / "password"


def run_redis_url(info: RunInfo) -> str:
    """The Redis URL of a `sluice run`, with the password from its 0600 file.
    Raises RunError when that file cannot be read."""
    if info.redis_password_file is None:
        return info.redis_url
    try:
        password = read_secret(Path(info.redis_password_file))
    except OSError as exc:
        raise RunError(
            f"cannot read the Redis password of the `sluice run` (pid {info.pid}) from "
            f"{info.redis_password_file}: {exc.strerror or exc}"
        ) from exc
    return with_password(info.redis_url, password)


def read_run_info(state_dir: Path) -> RunInfo | None:
    """The RunInfo of a `sluice run` alive on `state_dir`, or None."""
    try:
        info = msgspec.json.decode(run_info_path(state_dir).read_bytes(), type=RunInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return info if processes.running(info.pid) else None


class ServiceRun:
    """One `sluice run`; see the module docstring. `run()` blocks until it is over."""

    def __init__(self, config: RunConfig, *, out: TextIO | None = None) -> None:
        self._config = config
        self._out = out if out is not None else sys.stdout
        self._view = LiveView(self._out, tty=self._out.isatty())
        self._redis: EmbeddedRedis | None = None
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._info: RunInfo | None = None
        self._handles: dict[int, Handle] = {}  # replica id -> handle, last seen
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._upped = False

    # -- the whole run -----------------------------------------------------------------------

    def run(self) -> int:
        """Start everything, serve until a signal, stop everything. Returns the exit code;
        raises RunError (and the store's errors) after stopping what it started."""
        config = self._config
        # Errors before anything starts: a missing key or cert, a fixed replica port
        # several replicas (or the proxy) would need.
        tls_files(config.spec)
        check_fixed_port(config.spec)
        replica_port = fixed_port(config.spec)
        if replica_port is not None and replica_port == config.port:
            raise RunError(
                f"the proxy's --port {config.port} is the port the replica listens on "
                "(service.ports; the run command does not use $PORT); give the proxy "
                "another --port"
            )
        check_service_name(config.name)  # it becomes a directory name below
        private_dir(config.state_dir, enforce=False)  # 0700 if new; a user's dir is left as is
        other = read_run_info(config.state_dir)
        if other is not None and other.pid != os.getpid():
            raise RunError(
                f"another `sluice run` (pid {other.pid}, service {other.service}) uses "
                f"{config.state_dir}; give this one its own --state-dir"
            )
        try:
            with asyncio.Runner() as runner:
                return runner.run(self._main())
        finally:
            # Normally already done inside the loop; this is the net for an exception
            # that escaped it. Blocking is fine: nothing else runs any more.
            for role in ("proxy", "controller"):
                self._stop_child_sync(role)
            self._kill_replicas()
            self._stop_redis()
            for fh in self._logs:
                fh.close()
            if self._info is not None:
                with contextlib.suppress(OSError):
                    run_info_path(config.state_dir).unlink()
                if self._info.redis_password_file is not None:
                    with contextlib.suppress(OSError):  # no copy of a password outlives the run
                        Path(self._info.redis_password_file).unlink()

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal)
        config = self._config
        url = config.redis_url or self._start_redis()
        async with Store.from_url(url, prefix=config.prefix, ca_file=config.redis_ca_file) as store:
            await store.ping()
            if await store.service(config.name) is not None:
                raise ServiceExists(
                    f"service {config.name!r} already exists in {redact_url(url)}; "
                    "choose another name with -n"
                )
            port = config.port or processes.free_port()
            admin_port = config.admin_port or processes.free_port()
            scheme = "https" if config.spec.service.tls is not None else "http"
            endpoint = f"{scheme}://{_display_host(config.host)}:{port}"
            bare_url, password = split_password(url)
            if password is not None:
                private_dir(password_path(config.state_dir).parent)
                write_private(password_path(config.state_dir), password.encode())
            self._info = RunInfo(
                pid=os.getpid(),
                service=config.name,
                redis_url=bare_url,
                prefix=config.prefix,
                endpoint=endpoint,
                started_at=time.time(),
                pids={} if self._redis is None or self._redis.pid is None
                else {"redis": self._redis.pid},
                redis_password_file=None if password is None
                else str(password_path(config.state_dir)),
                redis_ca_file=config.redis_ca_file,
            )  # fmt: skip
            self._write_info()
            try:
                self._spawn_controller(url)
                self._spawn_proxy(url, port, admin_port)
                await self._wait_listening(admin_port)
                if self._stop.is_set():
                    return 0  # interrupted while starting: nothing registered yet
                await ops.up(store, config.name, config.spec, endpoint=endpoint)
                self._upped = True
                self._view.message(
                    f"sluice: service {config.name} at {endpoint} "
                    f"(state in {config.state_dir}; Ctrl-C to stop)"
                )
                return await self._watch(store, endpoint)
            finally:
                await self._shutdown(store)

    def _on_signal(self) -> None:
        if self._stop.is_set():
            self._hurry.set()  # a second Ctrl-C: stop waiting for a graceful shutdown
        self._stop.set()

    # -- while serving -----------------------------------------------------------------------

    async def _watch(self, store: Store, endpoint: str) -> int:
        config = self._config
        announced = False
        unreachable = False
        while not self._stop.is_set():
            self._check_children()
            try:
                view = (await ops.status(store, config.name))[0]
            except ServiceNotFound:
                self._view.message(f"sluice: service {config.name} was removed; stopping")
                return 0
            except StoreUnavailable as exc:
                if self._redis is not None and not self._redis.running:
                    raise RunError("the embedded redis-server exited") from exc
                if not unreachable:
                    self._view.message(f"sluice: redis unreachable ({exc}); retrying")
                unreachable = True
            else:
                unreachable = False
                self._remember_handles(await store.replicas(config.name))
                now = time.time()
                if view.status == ServiceStatus.SHUTTING_DOWN:
                    self._view.message(f"sluice: service {config.name} is being taken down")
                    return 0
                self._view.update(view, now)
                if not announced and view.ready > 0:
                    announced = True
                    self._view.message(f"sluice: {config.name} is ready at {endpoint}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(config.refresh):
                    await self._stop.wait()
        return 0

    async def _wait_listening(self, admin_port: int) -> None:
        """Until the proxy's admin port accepts (it binds its client port first), so that a
        port conflict fails the run before any replica is launched."""
        deadline = time.monotonic() + self._config.startup_timeout
        while not self._stop.is_set():
            self._check_children()
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", admin_port)
                writer.close()
                await writer.wait_closed()
                return
            if time.monotonic() > deadline:
                raise RunError(
                    f"the proxy did not listen within {self._config.startup_timeout:g}s "
                    f"(log: {self._log_path('proxy')})"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POLL):
                    await self._stop.wait()

    def _check_children(self) -> None:
        for role, proc in self._children.items():
            code = proc.poll()
            if code is not None:
                raise RunError(
                    f"the {role} exited with code {code}: {_last_line(self._log_path(role))} "
                    f"(log: {self._log_path(role)})"
                )
        if self._redis is not None and not self._redis.running:
            raise RunError("the embedded redis-server exited")

    def _remember_handles(self, replicas: dict[int, ReplicaRecord]) -> None:
        for replica_id, record in replicas.items():
            if record.backend == "local" and record.handle:
                self._handles[replica_id] = record.handle

    # -- shutdown ----------------------------------------------------------------------------

    async def _shutdown(self, store: Store) -> None:
        config = self._config
        self._stop.set()
        self._view.clear()
        if self._upped:
            self._view.message(
                f"sluice: taking {config.name} down (replicas drain for "
                f"{config.drain_seconds:g}s; Ctrl-C again to stop at once)"
            )
            try:
                await ops.down(store, config.name)
                await self._wait_removed(store)
            except ServiceNotFound:
                pass  # already gone
            except StoreError as exc:
                # Stop the processes anyway; leftover replicas are killed below.
                self._view.message(f"sluice: could not take {config.name} down cleanly: {exc}")
        for role in ("proxy", "controller"):
            await self._stop_child(role)
        with contextlib.suppress(StoreError):  # what a controller that died left recorded
            self._remember_handles(await store.replicas(config.name))
        if self._kill_replicas():
            self._view.message("sluice: killed replicas the controller left running")
        self._stop_redis()
        self._view.message("sluice: stopped")

    async def _wait_removed(self, store: Store) -> None:
        """Until the controller has terminated every replica and unregistered the service,
        it died, `down_timeout` passed, or a second signal came."""
        deadline = time.monotonic() + self._config.down_timeout
        while time.monotonic() < deadline and not self._hurry.is_set():
            controller = self._children.get("controller")
            if controller is None or controller.poll() is not None:
                return
            if await store.service(self._config.name) is None:
                return
            self._remember_handles(await store.replicas(self._config.name))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self._config.refresh, 0.2)):
                    await self._hurry.wait()
        if self._hurry.is_set():
            self._view.message("sluice: stopping at once")
        else:
            self._view.message(
                f"sluice: replicas not terminated within {self._config.down_timeout:g}s; "
                "stopping them directly"
            )

    async def _stop_child(self, role: str) -> None:
        proc = self._children.get(role)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        timeout = 0.5 if self._hurry.is_set() else self._config.stop_timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, timeout)
        if proc.poll() is None:
            self._view.message(f"sluice: the {role} ignored SIGTERM; killing it")
            proc.kill()
            proc.wait()

    def _stop_child_sync(self, role: str) -> None:
        proc = self._children.get(role)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self._config.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s pid %d ignored SIGTERM; killing it", role, proc.pid)
                proc.kill()
                proc.wait()

    def _kill_replicas(self) -> bool:
        """SIGTERM, then SIGKILL, the process group of every local replica still running
        (the handle's pid and start time must match). True if there was any.

        Besides the handles seen in Redis, the local backend's handle files: a replica
        spawned by a controller that died before recording it (or before this run saw
        the record) is found there."""
        handles = [*self._handles.values(), *recorded_handles(self._config.state_dir,
                                                              self._config.name)]  # fmt: skip
        alive = [h for h in handles if _replica_running(h)]
        for handle in alive:
            _signal_group(handle, signal.SIGTERM)
        deadline = time.monotonic() + self._config.stop_timeout
        while any(_replica_running(h) for h in alive) and time.monotonic() < deadline:
            time.sleep(_POLL)
        for handle in alive:
            _signal_group(handle, signal.SIGKILL)
        self._handles.clear()
        return bool(alive)

    def _stop_redis(self) -> None:
        if self._redis is not None:
            self._redis.stop(timeout=self._config.stop_timeout)
            self._redis = None

    # -- starting ----------------------------------------------------------------------------

    def _start_redis(self) -> str:
        # A random password even on 127.0.0.1: any local user could otherwise register
        # a service whose `run:` the controller executes as this user.
        self._redis = EmbeddedRedis(self._config.state_dir / "redis",
                                    password=secrets.token_urlsafe(32))  # fmt: skip
        self._redis.start()
        return self._redis.url

    def _log_path(self, role: str) -> Path:
        if role == "controller":
            return self._config.state_dir / "controller.log"
        return self._config.state_dir / self._config.name / f"{role}.log"

    def _spawn(self, role: str, argv: list[str], url: str) -> None:
        log_path = self._log_path(role)
        if log_path.parent != self._config.state_dir:
            private_dir(log_path.parent)
        out = os.fdopen(open_private_append(log_path), "ab")
        self._logs.append(out)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The URL (with its password) and the CA file go in the environment: argv is
        # world-readable (ps, /proc/PID/cmdline), the environment is not.
        env["SLUICE_REDIS_URL"] = url
        env.pop("SLUICE_REDIS_CA_FILE", None)
        if self._config.redis_ca_file is not None:
            env["SLUICE_REDIS_CA_FILE"] = self._config.redis_ca_file
        # The children import this package: make it importable without an install too.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._children[role] = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a terminal Ctrl-C reaches us only; we stop them in order
            preexec_fn=processes.die_with_parent_hook(),
        )
        if self._info is not None:
            self._info.pids[role] = self._children[role].pid
            self._write_info()

    def _spawn_controller(self, url: str) -> None:
        config = self._config
        argv = ["-m", "controlplane.cli", "controller", "--prefix", config.prefix,
                "--state-dir", str(config.state_dir),
                "--drain-seconds", f"{config.drain_seconds:g}",
                "--log-level", config.log_level, "--backend", config.backend]  # fmt: skip
        if self._redis is not None:
            # Our private Redis holds only this service: whatever the controller leaves
            # running when it exits is ours. (A shared Redis may hold other services.)
            argv.append("--terminate-on-exit")
        self._spawn("controller", argv, url)

    def _spawn_proxy(self, url: str, port: int, admin_port: int) -> None:
        config = self._config
        service = config.spec.service
        argv = ["-m", "proxy.cli", "--redis-prefix", config.prefix,
                "--service", config.name, "--host", config.host, "--port", str(port),
                "--admin-port", str(admin_port), "--shutdown-grace", f"{config.stop_timeout / 2:g}",
                "--stream-idle-timeout", f"{service.load_balancer.stream_timeout_seconds:g}",
                "--log-level", config.log_level]  # fmt: skip
        tls = tls_files(config.spec)
        if tls is not None:
            argv += ["--tls-certfile", str(tls[0]), "--tls-keyfile", str(tls[1])]
        self._spawn("proxy", argv, url)

    def _write_info(self) -> None:
        assert self._info is not None
        write_private(run_info_path(self._config.state_dir), msgspec.json.encode(self._info))


def tls_files(spec: ServiceSpec) -> tuple[Path, Path] | None:
    """The spec's `service.tls` (certfile, keyfile) as absolute paths, `~` expanded (Sky
    Serve expands them too: serve_utils.TLSCredential); None without TLS. Raises RunError
    naming the field when a file is missing."""
    tls = spec.service.tls
    if tls is None:
        return None
    paths = []
    for field, given in (("certfile", tls.certfile), ("keyfile", tls.keyfile)):
        path = Path(given).expanduser().absolute()
        if not path.is_file():
            raise RunError(f"service.tls.{field}: no file at {path} (given as {given!r})")
        paths.append(path)
    return paths[0], paths[1]


def run_service(config: RunConfig, *, out: TextIO | None = None) -> int:
    """Run `config`'s service in the foreground; see the module docstring."""
    return ServiceRun(config, out=out).run()


# -- process helpers -------------------------------------------------------------------------


def _replica_running(handle: Handle) -> bool:
    """True if the handle's process runs and is the one the backend started."""
    pid = handle.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    return processes.running(pid, handle.get("start_time"))


def _signal_group(handle: Handle, sig: int) -> None:
    pid = handle.get("pid")
    if (
        isinstance(pid, int)
        and pid > 0
        and _replica_running(handle)
        and processes.owns_group(pid, handle.get("start_time"))  # never a stranger's group
    ):
        processes.signal_group(pid, sig)  # the local backend's replica: pid == its group


def _display_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            lines = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return lines[-1].strip() if lines else "no output"
