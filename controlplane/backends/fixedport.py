"""The fixed-port rule of the local backend.

Each local replica gets a free 127.0.0.1 port in `PORT`, unless the spec names a
port (`service.ports`, or the one `resources.ports`) and its run command spells that
port out (after `$VAR` from envs and secrets) without using `$PORT`: a Sky Serve
YAML such as `vllm serve --port 8080`, whose replica listens on that fixed port
whatever sluice says. (A program that reads the PORT variable itself, like
examples/echo_server.py, is not fixed: its run command names no port.) That replica
is run with `PORT` set to the fixed port and probed and routed there;
`check_fixed_port` refuses (at `up`, `update`, `run`) a spec that could need two
replicas on it at once, so the mistake is one error instead of a replica probed on
the wrong port until its initial delay runs out.
"""

from __future__ import annotations

import re
import socket

from controlplane.backends.base import BackendError
from controlplane.servicespec import ServiceSpec, fill_in_env_vars, is_count_only_change

_USES_PORT = re.compile(r"\$\{?PORT\b")


class PortConflict(BackendError):
    """Local replicas of a spec would need the same fixed port at once."""


def fixed_port(spec: ServiceSpec) -> int | None:
    """The port a local replica of `spec` listens on whatever sluice says: the spec's
    port when its run command names it (`--port 8080`, `0.0.0.0:8080`, `--port $P` with
    `envs: {P: 8080}`) and does not use `$PORT`; None when each replica gets a free
    port."""
    port = spec.replica_port
    if port is None or not spec.run or _USES_PORT.search(spec.run):
        return None
    run = fill_in_env_vars(spec.run, {**spec.envs, **spec.secrets})
    return port if re.search(rf"(?<![\w.]){port}(?![\w.])", run) else None


def check_fixed_port(spec: ServiceSpec, previous: ServiceSpec | None = None) -> None:
    """Raise PortConflict when local replicas of `spec` could need its fixed port twice at
    once: more than one replica, or (`previous`: the version it updates) a new replica
    started while the old one, on the same fixed port, still runs."""
    port = fixed_port(spec)
    if port is None:
        return
    why = (
        f"service.ports: the replicas listen on the fixed port {port} (the run command "
        "does not use $PORT), so the local backend can serve only one replica at a time"
    )
    fix = ("listen on $PORT instead (sluice sets it for each replica), use --backend "
           "skypilot (each replica its own cluster)")
    scaling = spec.service.scaling
    most = spec.max_replicas + scaling.num_overprovision + scaling.base_ondemand_fallback_replicas
    if most > 1 or scaling.dynamic_ondemand_fallback:
        raise PortConflict(f"{why}, but this spec runs up to {most}; {fix}, or run one replica")
    if (
        previous is not None
        and fixed_port(previous) == port
        and not is_count_only_change(previous, spec)
    ):
        raise PortConflict(
            f"{why}: the new version's replica cannot start while the old one holds the "
            f"port; {fix}, or take the service down and up again"
        )


def bindable(port: int) -> bool:
    """True when nothing listens on `port` (any IPv4 address) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True

