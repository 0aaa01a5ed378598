"""What `sluice run` is given (`RunConfig`, built by the CLI) and what it leaves for
the other commands while it runs (`RunInfo`, `{state_dir}/run.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from controlplane import processes
from controlplane.reconcile import ControllerConfig
from controlplane.servicespec import ServiceSpec
from controlplane.statedir import StateDir, read_secret, with_password, write_private
from proxy.wire.errors import SluiceError
from proxy.wire.keys import DEFAULT_PREFIX


class RunError(SluiceError):
    """`sluice run` could not start, or a process it started died under it."""


#: Seconds Ctrl-C waits past the drain bound for the replicas to be terminated.
DOWN_SLACK = 30.0


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything `sluice run` needs; built by the CLI (whose option defaults are these)."""

    spec: ServiceSpec
    name: str
    state_dir: Path
    redis_url: str | None = None  # None: start a private redis-server
    redis_ca_file: str | None = None  # the CA of a rediss:// server (None: the system's)
    prefix: str = DEFAULT_PREFIX
    # The proxy's listen address: loopback, as dev servers default to; 0.0.0.0 (or
    # an address) to serve other machines.
    host: str = "127.0.0.1"
    port: int = 8080  # the proxy's port; 0 picks a free one
    admin_port: int = 0  # the proxy's admin port; 0 picks a free one
    drain_seconds: float = 120.0  # the controller's maximum drain (stops when idle)
    # How long Ctrl-C waits for the controller to drain and terminate the replicas;
    # None: the service's drain bound plus DOWN_SLACK (a shorter wait would stop
    # replicas while they still stream, which the drain bound is there to avoid).
    down_timeout: float | None = None
    stop_timeout: float = 10.0  # SIGTERM -> SIGKILL, per process
    startup_timeout: float = 30.0  # for the proxy to listen
    refresh: float = 0.5  # seconds between status refreshes
    log_level: str = "INFO"
    # What the controller launches replicas with: local | skypilot.
    backend: str = ControllerConfig.backend


    @property
    def max_drain(self) -> float:
        """The drain bound the controller applies to this service (the spec's
        service.sluice.max_drain_seconds, else --max-drain-seconds)."""
        sluice = self.spec.service.sluice
        if sluice is not None and sluice.max_drain_seconds is not None:
            return sluice.max_drain_seconds
        return self.drain_seconds

    @property
    def down_wait(self) -> float:
        """How long Ctrl-C waits for the replicas to drain and be terminated."""
        if self.down_timeout is not None:
            return self.down_timeout
        return self.max_drain + DOWN_SLACK


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
    listen: str = ""  # the proxy's host:port, e.g. 0.0.0.0:8080 ("" from an older run)
    admin: str = ""  # the proxy's admin URL, http://127.0.0.1:PORT
    backend: str = "local"  # what the controller launches replicas with


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
        info = msgspec.json.decode(StateDir(state_dir).run_info.read_bytes(), type=RunInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return info if processes.running(info.pid) else None


def write_run_info(state_dir: Path, info: RunInfo) -> None:
    """Replace `{state_dir}/run.json` with `info` (0600)."""
    write_private(StateDir(state_dir).run_info, msgspec.json.encode(info))


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
