"""Builders for the records and snapshots tests feed the product: one place, so a new
field with a default changes one function, not twenty tests.

- `replica(i, ...)`: a READY `ReplicaRecord` of version 1 at a unique loopback URL.
- `service(name, ...)` / `registered(store, name, ...)`: a READY `ServiceRecord`, and
  the same registered in a Store.
- `snapshot(generation, *replicas, ...)`: a `ReadySnapshot`; replicas given as URLs get
  ids counted from `first_id`.
- `make_spec(replicas, ...)`: a `ServiceSpec` running `tests.support.replica_app` from
  this checkout (probe settings fast enough for tests), and `pid_of(record)`.
- `ready_view(store, name, n)`: wait until a service has exactly n READY replicas.
- `Fake` / `fakes(*loads)`: stand-in replicas for the pure policies (what a policy
  reads of a replica: name, in-flight count, accelerator, target QPS).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from controlplane import ops
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot
from tests.support.processes import REPO

# -- records -------------------------------------------------------------------------------


def replica(
    i: int,
    *,
    status: ReplicaStatus = ReplicaStatus.READY,
    version: int = 1,
    url: str | None = None,
    **fields: Any,
) -> ReplicaRecord:
    """Replica `i`; its URL (unless given) is 127.0.0.1 port 20000 + i, unique per id."""
    if url is None:
        url = f"http://127.0.0.1:{20000 + i}"
    return ReplicaRecord(id=i, status=status, version=version, url=url, **fields)


def service(
    name: str = "svc", *, status: ServiceStatus = ServiceStatus.READY, **fields: Any
) -> ServiceRecord:
    return ServiceRecord(name=name, status=status, **fields)


async def registered(
    store: Store, name: str = "svc", *, spec: bytes = b'{"replicas": 2}', **fields: Any
) -> ServiceRecord:
    """`service(name, **fields)` registered in `store` with the spec JSON `spec`."""
    record = service(name, **fields)
    await store.register_service(record, spec)
    return record


# -- the wire snapshot ---------------------------------------------------------------------


def snapshot(
    generation: int,
    *replicas: str | ReadyReplica,
    service: str = "s",
    first_id: int = 0,
    **fields: Any,
) -> ReadySnapshot:
    """A ReadySnapshot published at 0.0; URL strings become ReadyReplicas with ids counted
    from `first_id`; `fields` are the snapshot's other fields (policy, status, ...)."""
    infos = tuple(
        r if isinstance(r, ReadyReplica) else ReadyReplica(id=first_id + i, url=r)
        for i, r in enumerate(replicas)
    )
    fields.setdefault("published_at", 0.0)
    return ReadySnapshot(service=service, generation=generation, replicas=infos, **fields)


# -- what the pure policies choose from --------------------------------------------------


@dataclass(eq=False)  # hashed by identity, like the real Replica
class Fake:
    name: str
    inflight: int = 0
    accelerator: str | None = None
    target_qps: float | None = None
    engine_queue: int = 0
    peer_inflight: int = 0
    peer_seen: int = 0
    prefilling: int = 0
    prefill_bytes: int = 0


def fakes(*loads: int) -> list[Fake]:
    """Fakes named r0, r1, ... with these in-flight counts."""
    return [Fake(f"r{i}", load) for i, load in enumerate(loads)]


# -- specs of services that run real replicas ----------------------------------------------

RUN = f"exec {sys.executable} -m tests.support.replica_app --port $PORT --id $SLUICE_REPLICA_ID"
PROBE: dict[str, Any] = {
    "path": "/health",
    "endpoint_probe_interval_seconds": 0.2,
    "timeout_seconds": 2,
    "initial_delay_seconds": 20,
    "consecutive_failure_threshold_timeout": 2,
}


def make_spec(
    replicas: int = 2,
    *,
    run: str | None = RUN,
    env: str = "a",
    probe: dict[str, Any] | None = None,
    setup: str | None = None,
) -> ServiceSpec:
    """`replicas` local replicas of `tests.support.replica_app` (env VARIANT=`env`)."""
    doc: dict[str, Any] = {
        "service": {"readiness_probe": {**PROBE, **(probe or {})}, "replicas": replicas},
        "workdir": str(REPO),
        "envs": {"VARIANT": env},
    }
    if run is not None:
        doc["run"] = run
    if setup is not None:
        doc["setup"] = setup
    return parse_spec(doc)


def pid_of(record: ReplicaRecord) -> int:
    """The pid of a local replica, from its handle."""
    pid = record.handle["pid"]
    assert isinstance(pid, int)
    return pid


async def ready_view(
    store: Store, name: str, n: int, version: int | None = None, *, timeout: float = 30.0
) -> ops.ServiceView:
    """Wait until exactly `n` replicas exist, all READY (of `version` if given)."""

    def done(view: ops.ServiceView) -> bool:
        return (
            len(view.replicas) == n
            and all(r.status == "READY" for r in view.replicas)
            and (version is None or all(r.version == version for r in view.replicas))
        )

    return await ops.wait_for(store, name, done, timeout=timeout)
