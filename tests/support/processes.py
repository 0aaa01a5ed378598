"""Fixtures that run real replica and proxy processes on free 127.0.0.1 ports.

``replica_factory(n=1, *, ready_delay=0.0, ids=None, wait_ready=True,
startup_timeout=15.0)`` starts ``n`` processes of ``tests.support.replica_app`` and
returns them (a list of ``Replica``) once each answers ``/health`` 200 (with
``wait_ready=False``: once each answers at all).
``await replica_factory.astart(...)`` does the same without blocking the loop.

``proxy_factory(*args, replicas=None, workers=None, wait="auto",
startup_timeout=20.0, env=None, command=None)`` starts ``python -m proxy.cli``
(or ``command``, e.g. the ``sluice proxy`` console script) with ``args``
on a free port and admin port(s) (worker i on admin port + i; ``--host
127.0.0.1`` unless given) and returns a ``Proxy`` once every worker's admin
``/readyz`` (``wait="ready"``) or ``/healthz`` (``wait="health"``) answers 200;
``"auto"`` means ready when replicas are given, health otherwise. ``await
proxy_factory.astart(...)`` is the non-blocking form.

Every process is stopped by pid at teardown: SIGTERM, then SIGKILL (with its
children) after a grace. Polls are short and bounded; no fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import pytest

from tests.support.pids import descendants
from tests.support.poll import until, until_sync
from tests.support.ports import HOST, free_port

REPO = Path(__file__).resolve().parents[2]

def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """Blocking GET, for fixtures and sync checks: (status, body)."""
    return _get(http.client.HTTPConnection(host, port, timeout=timeout), path)


def https_get(
    host: str, port: int, path: str, context: ssl.SSLContext, timeout: float = 2.0
) -> tuple[int, bytes]:
    """Blocking GET over TLS: (status, body)."""
    return _get(http.client.HTTPSConnection(host, port, context=context, timeout=timeout), path)


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


async def ahttp_status(host: str, port: int, path: str) -> int:
    """Non-blocking GET returning only the status code; wrap it in asyncio.timeout."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        line = await reader.readline()
        return int(line.split()[1])
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class Process:
    """A child process we own: started with its output in a log file, stopped by pid."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # closed in _reap
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p
        )
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=full_env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def output(self) -> str:
        """Everything the process wrote to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def send(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    async def exited(self, within: float) -> int:
        """Poll until the process exits (without blocking the loop) and return its code;
        fail, with its output, if it still runs after `within` seconds."""
        try:
            await until(lambda: not self.alive, timeout=within, what=f"{self!r} to exit",
                        interval=0.05)  # fmt: skip
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{self.output()}")
        code = self.returncode
        assert code is not None
        return code

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to timeout, then SIGKILL it and its children."""
        self.send(signal.SIGTERM)
        return self._reap(time.monotonic() + timeout)

    def _reap(self, deadline: float) -> int:
        if self.alive:
            kids = descendants(self.pid)
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for pid in [self.pid, *kids, *descendants(self.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def _check_running(self, what: str) -> None:
        if not self.alive:
            self._reap(0)
            raise RuntimeError(
                f"{what} exited with {self.proc.returncode} before it was up:\n{self.output()}"
            )


class Replica(Process):
    def __init__(self, port: int, replica_id: str, ready_delay: float, log_dir: Path) -> None:
        self.port = port
        self.id = replica_id
        self.url = f"http://{HOST}:{port}"
        argv = [sys.executable, "-m", "tests.support.replica_app", "--port", str(port),
                "--id", replica_id]  # fmt: skip
        if ready_delay:
            argv += ["--ready-delay", str(ready_delay)]
        super().__init__(argv, log_dir / f"replica-{replica_id}-{port}.log", None)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send sig; for SIGKILL also reap, so the port is free and `alive` is False on return."""
        self.send(sig)
        if sig == signal.SIGKILL:
            self.wait(5)

    def stats(self) -> dict[str, Any]:
        """This replica's /stats (requests by path, cancelled, in flight)."""
        status, body = http_get(HOST, self.port, "/stats")
        assert status == 200, status
        result: dict[str, Any] = json.loads(body)
        return result

    def __repr__(self) -> str:
        return f"Replica(id={self.id!r}, url={self.url!r}, pid={self.pid})"


class Proxy(Process):
    def __init__(
        self, args: Sequence[str], port: int, admin_port: int, workers: int, log_dir: Path,
        env: dict[str, str] | None, command: Sequence[str] | None = None,
    ) -> None:  # fmt: skip
        self.port = port
        self.admin_port = admin_port  # worker i listens on admin_port + i
        self.workers = workers
        scheme = "https" if "--tls-certfile" in args else "http"
        self.url = f"{scheme}://{HOST}:{port}"
        self.admin_url = f"http://{HOST}:{admin_port}"
        self.admin_urls = [f"http://{HOST}:{admin_port + i}" for i in range(workers)]
        argv = [*(command or (sys.executable, "-m", "proxy.cli")), "--port", str(port),
                "--admin-port", str(admin_port), *args]  # fmt: skip
        if "--host" not in args:
            argv += ["--host", HOST]
        super().__init__(argv, log_dir / f"proxy-{port}.log", env)

    def terminate(self) -> None:
        """SIGTERM (graceful drain); returns at once. Use wait() or stop() to reap."""
        self.send(signal.SIGTERM)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.send(sig)

    def stderr_text(self) -> str:
        """What the proxy logged (stdout and stderr share one file)."""
        return self.output()

    def worker_pids(self) -> list[int]:
        return descendants(self.pid)

    def admin_get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        return http_get(HOST, self.admin_port, path, timeout)

    def __repr__(self) -> str:
        return f"Proxy(url={self.url!r}, admin_url={self.admin_url!r}, pid={self.pid})"


WaitMode = Literal["auto", "ready", "health", "none"]
_Target = tuple[Process, int, str, bool]  # process, port, path, whether it must answer 200


class _Factory:
    """Owns every process it started; closes them all at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Process] = []

    def close(self, timeout: float = 10.0) -> None:
        for p in self.started:
            p.send(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.started:
            p._reap(deadline)

    @staticmethod
    def _answers(proc: Process, port: int, path: str, need_200: bool, what: str) -> bool:
        proc._check_running(what)
        with contextlib.suppress(OSError, http.client.HTTPException):
            return http_get(HOST, port, path, timeout=1.0)[0] == 200 or not need_200
        return False

    @staticmethod
    async def _answers_async(
        proc: Process, port: int, path: str, need_200: bool, what: str
    ) -> bool:
        proc._check_running(what)
        with contextlib.suppress(OSError, ValueError, IndexError, TimeoutError):
            async with asyncio.timeout(1.0):
                status = await ahttp_status(HOST, port, path)
            return status == 200 or not need_200
        return False

    @classmethod
    def _wait_sync(cls, targets: Sequence[_Target], within: float, what: str) -> None:
        deadline = time.monotonic() + within
        for proc, port, path, need_200 in targets:
            try:
                until_sync(
                    lambda: cls._answers(proc, port, path, need_200, what),  # noqa: B023
                    timeout=max(0.0, deadline - time.monotonic()),
                    what=f"{what} {proc.pid} to answer {path} on port {port}",
                )
            except AssertionError as exc:
                raise TimeoutError(f"{exc}:\n{proc.output()}") from None

    @classmethod
    async def _wait_async(cls, targets: Sequence[_Target], within: float, what: str) -> None:
        deadline = time.monotonic() + within
        for proc, port, path, need_200 in targets:
            try:
                await until(
                    lambda: cls._answers_async(proc, port, path, need_200, what),  # noqa: B023
                    timeout=max(0.0, deadline - time.monotonic()),
                    what=f"{what} {proc.pid} to answer {path} on port {port}",
                )
            except AssertionError as exc:
                raise TimeoutError(f"{exc}:\n{proc.output()}") from None


class ReplicaFactory(_Factory):
    def _spawn(self, n: int, ready_delay: float, ids: Sequence[str] | None) -> list[Replica]:
        if ids is not None and len(ids) != n:
            raise ValueError("ids must have n entries")
        out = []
        for i in range(n):
            port = free_port()
            r = Replica(port, ids[i] if ids else str(port), ready_delay, self.log_dir)
            self.started.append(r)
            out.append(r)
        return out

    @staticmethod
    def _targets(reps: list[Replica], wait_ready: bool) -> list[_Target]:
        # wait_ready=False: any HTTP answer from /health (even 503) means it is listening.
        return [(r, r.port, "/health", wait_ready) for r in reps]

    def __call__(
        self, n: int = 1, *, ready_delay: float = 0.0, ids: Sequence[str] | None = None,
        wait_ready: bool = True, startup_timeout: float = 15.0,
    ) -> list[Replica]:  # fmt: skip
        reps = self._spawn(n, ready_delay, ids)
        self._wait_sync(self._targets(reps, wait_ready), startup_timeout + ready_delay, "replica")
        return reps

    async def astart(
        self, n: int = 1, *, ready_delay: float = 0.0, ids: Sequence[str] | None = None,
        wait_ready: bool = True, startup_timeout: float = 15.0,
    ) -> list[Replica]:  # fmt: skip
        reps = self._spawn(n, ready_delay, ids)
        await self._wait_async(
            self._targets(reps, wait_ready), startup_timeout + ready_delay, "replica"
        )
        return reps


class ProxyFactory(_Factory):
    def _spawn(
        self, args: Sequence[str], replicas: Sequence[Replica | str] | None,
        workers: int | None, env: dict[str, str] | None, wait: WaitMode,
        command: Sequence[str] | None = None,
    ) -> tuple[Proxy, list[_Target]]:  # fmt: skip
        argv = list(args)
        if replicas is not None:
            urls = [r.url if isinstance(r, Replica) else r for r in replicas]
            argv += ["--replicas", ",".join(urls)]
        if workers is not None:
            argv += ["--workers", str(workers)]
        n = workers or 1
        p = Proxy(argv, free_port(), free_port(n), n, self.log_dir, env, command)
        self.started.append(p)
        if wait == "auto":
            wait = "ready" if replicas else "health"
        paths = {"ready": "/readyz", "health": "/healthz"}
        targets: list[_Target] = []
        if wait != "none":  # every worker, so every one is serving on return
            targets += [(p, p.admin_port + i, paths[wait], True) for i in range(n)]
        return p, targets

    def __call__(
        self, *args: str, replicas: Sequence[Replica | str] | None = None,
        workers: int | None = None, wait: WaitMode = "auto", startup_timeout: float = 20.0,
        env: dict[str, str] | None = None, command: Sequence[str] | None = None,
    ) -> Proxy:  # fmt: skip
        p, targets = self._spawn(args, replicas, workers, env, wait, command)
        self._wait_sync(targets, startup_timeout, "proxy")
        return p

    async def astart(
        self, *args: str, replicas: Sequence[Replica | str] | None = None,
        workers: int | None = None, wait: WaitMode = "auto", startup_timeout: float = 20.0,
        env: dict[str, str] | None = None, command: Sequence[str] | None = None,
    ) -> Proxy:  # fmt: skip
        p, targets = self._spawn(args, replicas, workers, env, wait, command)
        await self._wait_async(targets, startup_timeout, "proxy")
        return p


F = TypeVar("F", bound=_Factory)


def closed_after(factory: F, timeout: float) -> Iterator[F]:
    """A factory fixture's body: yield `factory`, then stop every process it started
    (SIGTERM, SIGKILL after `timeout` s)."""
    try:
        yield factory
    finally:
        factory.close(timeout=timeout)


@pytest.fixture
def replica_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaFactory]:
    yield from closed_after(ReplicaFactory(tmp_path_factory.mktemp("replicas")), 5.0)


@pytest.fixture
def proxy_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyFactory]:
    yield from closed_after(ProxyFactory(tmp_path_factory.mktemp("proxy")), 10.0)
