"""`ServiceRun`: one `sluice run`, from the first child started to the last one stopped
(the order is in the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

import msgspec

from controlplane import ops, processes
from controlplane.backends.fit import check_backend, check_run_command
from controlplane.backends.fixedport import fixed_port
from controlplane.backends.localproc import recorded_handles, stop_groups
from controlplane.display import LiveView
from controlplane.records import Handle, ReplicaRecord, check_service_name
from controlplane.redisserver import EmbeddedRedis
from controlplane.run.children import Children
from controlplane.run.config import (
    RunConfig,
    RunError,
    RunInfo,
    read_run_info,
    tls_files,
    write_run_info,
)
from controlplane.statedir import (
    StateDir,
    private_dir,
    redact_url,
    split_password,
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

_POLL = 0.05  # how often a starting proxy is looked at


class ServiceRun:
    """One `sluice run`; see the module docstring. `run()` blocks until it is over."""

    def __init__(self, config: RunConfig, *, out: TextIO | None = None) -> None:
        self._config = config
        self._out = out if out is not None else sys.stdout
        self._view = LiveView(self._out, tty=self._out.isatty())
        self._layout = StateDir(config.state_dir)
        self._redis: EmbeddedRedis | None = None
        self._children = Children(config, self._on_spawn)
        self._info: RunInfo | None = None
        self._handles: dict[int, Handle] = {}  # replica id -> handle, last seen
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._upped = False
        self._verdict: str | None = None  # why the service can never become ready

    # -- the whole run -----------------------------------------------------------------------

    def run(self) -> int:
        """Start everything, serve until a signal, stop everything. Returns the exit code;
        raises RunError (and the store's errors) after stopping what it started."""
        config = self._config
        # Errors before anything starts: a missing key or cert, a fixed replica port
        # several replicas (or the proxy) would need.
        tls_files(config.spec)
        check_backend(config.spec, config.backend)
        check_run_command(config.spec, config.backend)
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
                self._children.stop_sync(role)
            self._kill_replicas()
            self._stop_redis()
            self._children.close_logs()
            if self._info is not None:
                with contextlib.suppress(OSError):
                    self._layout.run_info.unlink()
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
                private_dir(self._layout.redis_password.parent)
                write_private(self._layout.redis_password, password.encode())
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
                else str(self._layout.redis_password),
                redis_ca_file=config.redis_ca_file,
                listen=f"{_listen_host(config.host)}:{port}",
                admin=f"http://127.0.0.1:{admin_port}",
                backend=config.backend,
            )  # fmt: skip
            self._write_info()
            try:
                # Our private Redis holds only this service: whatever the controller
                # leaves running when it exits is ours. (A shared Redis may hold others.)
                self._children.spawn_controller(url, terminate_on_exit=self._redis is not None)
                self._children.spawn_proxy(url, port, admin_port)
                await self._wait_listening(admin_port)
                if self._stop.is_set():
                    return 0  # interrupted while starting: nothing registered yet
                await ops.up(store, config.name, config.spec, endpoint=endpoint)
                self._upped = True
                for line in self._banner(endpoint, port, admin_port):
                    self._view.message(line)
                return await self._watch(store, endpoint)
            finally:
                await self._shutdown(store)

    def _banner(self, endpoint: str, port: int, admin_port: int) -> list[str]:
        """What the run says once the service is registered: where clients go, where the
        proxy listens, its admin port, where the logs are."""
        config, layout = self._config, self._layout
        listen = _listen_host(config.host)
        where = " (every interface)" if config.host in ("", "0.0.0.0", "::") else ""
        return [
            f"sluice: service {config.name} at {endpoint} (the proxy listens on "
            f"{listen}:{port}{where}; admin http://127.0.0.1:{admin_port}/metrics)",
            f"sluice: logs: sluice logs {config.name} (replicas, --controller: "
            f"{layout.controller_log}, --load-balancer: {layout.proxy_log(config.name)}); "
            f"state in {config.state_dir}; Ctrl-C to stop (streams drain, up to "
            f"{config.max_drain:g}s; twice: at once)",
        ]

    def _with_logs(self, view: ops.ServiceView) -> ops.ServiceView:
        """`view` with the log path of local replicas whose handle is gone (the controller
        empties the handle of a replica it terminated; its log stays)."""
        replicas = []
        for r in view.replicas:
            path = self._layout.replica_log(view.name, r.id)
            if r.log is None and r.backend == "local" and path.is_file():
                r = msgspec.structs.replace(r, log=str(path))
            replicas.append(r)
        return msgspec.structs.replace(view, replicas=replicas)

    def _never_ready(self, view: ops.ServiceView) -> str:
        why = view.launch_blocked or f"service {view.name} FAILED"
        logs = [r.log for r in view.replicas if r.log] or [f"sluice logs {view.name} ID"]
        return (
            f"{view.name} can never become ready: {why}; nothing more will be launched. "
            f"Logs: {', '.join(logs[:3])}, {self._layout.controller_log}"
        )

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
                view = self._with_logs(view)
                now = time.time()
                if view.status == ServiceStatus.SHUTTING_DOWN:
                    self._view.message(f"sluice: service {config.name} is being taken down")
                    return 0
                self._view.update(view, now)
                if view.status == ServiceStatus.FAILED and view.version == 1:
                    # The only version gave up (every replica failed before it was ever
                    # ready): nothing will launch again, so waiting would be silent forever.
                    self._verdict = self._never_ready(view)
                    return 1
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
                    f"(log: {self._children.log_path('proxy')})"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POLL):
                    await self._stop.wait()

    def _check_children(self) -> None:
        self._children.check()
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
                f"sluice: taking {config.name} down (replicas drain until idle, at most "
                f"{config.max_drain:g}s; Ctrl-C again to stop at once)"
            )
            if config.down_wait < config.max_drain:
                self._view.message(
                    f"sluice: --down-timeout {config.down_wait:g}s is below the drain bound: "
                    "requests still running then are cut"
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
            await self._children.stop(role, hurry=self._hurry.is_set(), say=self._view.message)
        with contextlib.suppress(StoreError):  # what a controller that died left recorded
            self._remember_handles(await store.replicas(config.name))
        if self._kill_replicas():
            self._view.message("sluice: killed replicas the controller left running")
        self._stop_redis()
        self._view.message("sluice: stopped")
        if self._verdict is not None:
            self._view.message(f"sluice: {self._verdict}")

    async def _wait_removed(self, store: Store) -> None:
        """Until the controller has terminated every replica and unregistered the service,
        it died, `down_timeout` passed, or a second signal came."""
        deadline = time.monotonic() + self._config.down_wait
        while time.monotonic() < deadline and not self._hurry.is_set():
            if not self._children.alive("controller"):
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
                f"sluice: replicas not terminated within {self._config.down_wait:g}s; "
                "stopping them directly"
            )

    def _kill_replicas(self) -> bool:
        """SIGTERM, then SIGKILL, the process group of every local replica still running
        (the handle's pid and start time must match). True if there was any.

        Besides the handles seen in Redis, the local backend's handle files: a replica
        spawned by a controller that died before recording it (or before this run saw
        the record) is found there."""
        handles = [*self._handles.values(), *recorded_handles(self._config.state_dir,
                                                              self._config.name)]  # fmt: skip
        killed = stop_groups(handles, timeout=self._config.stop_timeout)
        self._handles.clear()
        return killed

    def _stop_redis(self) -> None:
        if self._redis is not None:
            self._redis.stop(timeout=self._config.stop_timeout)
            self._redis = None

    # -- starting ----------------------------------------------------------------------------

    def _start_redis(self) -> str:
        # A random password even on 127.0.0.1: any local user could otherwise register
        # a service whose `run:` the controller executes as this user.
        self._redis = EmbeddedRedis(self._layout.redis_dir,
                                    password=secrets.token_urlsafe(32))  # fmt: skip
        self._redis.start()
        return self._redis.url

    def _on_spawn(self, role: str, pid: int) -> None:
        if self._info is not None:
            self._info.pids[role] = pid
            self._write_info()

    def _write_info(self) -> None:
        assert self._info is not None
        write_run_info(self._config.state_dir, self._info)


def run_service(config: RunConfig, *, out: TextIO | None = None) -> int:
    """Run `config`'s service in the foreground; see the module docstring."""
    return ServiceRun(config, out=out).run()



def _display_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _listen_host(host: str) -> str:
    return f"[{host}]" if ":" in host else (host or "0.0.0.0")
