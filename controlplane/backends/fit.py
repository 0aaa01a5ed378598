"""Which backend can run a spec: the checks that depend on where replicas run.

A spec SkyPilot accepts is a valid sluice spec (`controlplane.servicespec` follows SkyPilot's
schema and Sky Serve's rules); some of those only one backend can run. `check_backend`
refuses them for the backend that cannot, in one line naming the field and the
backend that can:

    local     num_nodes > 1 (a local
              replica is one process, not a cluster); several replicas at once on
              one fixed port (`fixedport.check_fixed_port`: with SkyPilot each
              replica is its own cluster, so the same port is fine)
    skypilot  a replica port (service.ports, or one resources.ports), as Sky Serve
              requires: the local backend picks a free port when there is none
    external  nothing: sluice never launches those replicas

`up`, `update` and `run` check before anything is written; the local backend refuses
again at launch (a spec stored by another client). `check_run_command`: `sluice run`
of a spec without `run:` (the local backend would have nothing to start; `sluice up`
takes one, for replicas registered with `sluice replica add`).
"""

from __future__ import annotations

from controlplane.backends.base import BackendError
from controlplane.backends.fixedport import check_fixed_port
from controlplane.servicespec import ServiceSpec

BACKENDS = ("local", "skypilot")


class Unfit(BackendError):
    """The spec asks for something this backend cannot run."""


def check_backend(spec: ServiceSpec, backend: str, previous: ServiceSpec | None = None) -> None:
    """Raise Unfit (or fixedport.PortConflict) when `backend` cannot run `spec`;
    `previous` is the version it updates, if any."""
    if backend == "local":
        if spec.num_nodes > 1:
            raise Unfit(
                f"num_nodes: {spec.num_nodes} nodes per replica; the local backend runs "
                "a replica as one process: use --backend skypilot (a replica is a cluster "
                "there), or num_nodes: 1"
            )
        check_fixed_port(spec, previous)
    elif backend == "skypilot" and spec.replica_port is None:
        raise Unfit(
            "resources.ports: the skypilot backend needs the port a replica serves on "
            "(resources.ports: 8080, as Sky Serve); the local backend picks a free one"
        )


def check_run_command(spec: ServiceSpec, backend: str) -> None:
    """Raise Unfit when the local backend would launch replicas of `spec` and it has no
    `run` command (for `sluice run`: nothing would ever serve)."""
    launches = spec.max_replicas + spec.service.scaling.num_overprovision > 0
    if backend == "local" and launches and not spec.run:
        raise Unfit(
            "run: the local backend runs a replica's `run` command and this spec has "
            "none; add one (serving on $PORT or on service.ports), or use --backend "
            "skypilot, or register replicas with `sluice up` and `sluice replica add`"
        )
