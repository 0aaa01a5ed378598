"""The control plane's records, and the one pure function from them to a ReadySnapshot.

Records are msgspec Structs stored as JSON in Redis by `controlplane.store` (the
only package that reads or writes them). They are frozen: change one with
`msgspec.structs.replace(record, status=...)` and hand it to `Store.commit`.

`compute_snapshot` is the only place that decides which replicas a proxy may
route to; `Store.commit` calls it inside the transaction that writes the
records, so the snapshot in Redis always agrees with the records beside it.
Records allow unknown fields, so an older controller reads a newer one's data.

Pure data and functions: imports only controlplane.states and proxy.wire.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from typing import Annotated

import msgspec

from controlplane.states import ReplicaStatus, ServiceStatus, UpdateMode
from proxy.wire.errors import SluiceError
from proxy.wire.policies import DEFAULT_POLICY
from proxy.wire.snapshot import PrefixOptions, ReadyReplica, ReadySnapshot

#: Sky Serve's rule (sky/serve/constants.py SERVICE_NAME_VALID_REGEX), bounded like a DNS
#: label: a name is used in Redis keys and state-dir paths, so `/`, `.` and `:` never are.
SERVICE_NAME_PATTERN = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?")
SERVICE_NAME_MAX = 63


class InvalidServiceName(SluiceError, ValueError):
    """A service name that breaks the naming rule (`check_service_name`)."""


def check_service_name(name: str) -> str:
    """`name` if it is a valid service name; raises InvalidServiceName naming the rule."""
    if len(name) <= SERVICE_NAME_MAX and SERVICE_NAME_PATTERN.fullmatch(name):
        return name
    shown = name if len(name) <= 80 else name[:77] + "..."
    raise InvalidServiceName(
        f"invalid service name {shown!r}: use lowercase letters, digits and '-', starting "
        f"with a letter and not ending with '-', at most {SERVICE_NAME_MAX} characters"
    )


#: http(s)://host[:port][/path]: a URL the proxy can route to. Checked when a record is
#: decoded (`Store.commit` round-trips every record it writes), not by the constructor.
ReplicaUrl = Annotated[
    str,
    msgspec.Meta(pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[^\s/?#@:\[\]]+)(:[0-9]{1,5})?(/\S*)?$"),
]

#: Backend-specific way to find a replica again (pid and log path, cluster name ...).
Handle = dict[str, str | int | float | bool | None]


class ServiceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One service, stored field by field in the `{prefix}:svc:{name}` hash.

    `active_versions` is derived: `Store.commit` overwrites it with
    `compute_active_versions` of the records it commits.
    """

    name: str
    status: ServiceStatus = ServiceStatus.CONTROLLER_INIT
    version: int = 1  # the latest version; its spec is at `{prefix}:svc:{name}:spec:{version}`
    active_versions: tuple[int, ...] = ()
    update_mode: UpdateMode = UpdateMode.ROLLING
    policy: str = DEFAULT_POLICY  # the load-balancing policy proxies use
    prefix_options: PrefixOptions | None = None  # the `prefix` policy's (spec service.sluice)
    resume_streams: bool = False  # spec service.sluice.resume_streams, for the proxies
    endpoint: str | None = None  # where clients reach the service (the proxy's URL)
    created_at: float = 0.0
    # version -> min_replicas of that version's spec; blue_green switches to a version only
    # once this many of its replicas are READY (absent: 1).
    min_replicas: dict[int, int] = {}
    # The id the next replica of this service gets; ids are never reused.
    next_replica_id: int = 1
    # The latest version that ever had a READY replica (Sky Serve's
    # latest_version_ever_ready): a version that served is never given up.
    ready_version: int = 0

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"service name must be non-empty without ':' or spaces: {self.name!r}")
        if self.version < 1:
            raise ValueError(f"service {self.name}: version must be >= 1, got {self.version}")


class ReplicaRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One replica, stored as JSON under its id in the `{prefix}:svc:{name}:replicas` hash.

    Not tracked by the garbage collector (it holds no references back to itself):
    a commit decodes the whole table, and thousands of tracked objects per commit
    trigger collections that cost more than the commit.
    """

    id: int
    status: ReplicaStatus = ReplicaStatus.PENDING
    version: int = 1
    url: ReplicaUrl | None = None  # None until the backend knows it
    backend: str = "local"  # local | external | skypilot
    handle: Handle = {}
    spot: bool = False
    accelerator: str | None = None  # e.g. "A100:1", for instance_aware_least_load
    target_qps: float | None = None
    launched_at: float | None = None
    first_ready_at: float | None = None
    # The first failed probe of a replica never READY: its initial delay counts from here.
    first_not_ready_at: float | None = None
    status_since: float | None = None  # when `status` last changed (drain timing)
    failures: int = 0  # consecutive failed probes


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the `{prefix}:svc:{name}:events` stream (audit trail)."""

    id: str  # the stream entry id
    kind: str  # e.g. update, launch, terminate, failure
    at: float
    fields: dict[str, str] = {}


class AutoscalerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's last autoscaling decision for a service, for `sluice status`.

    Stored as JSON at `{prefix}:svc:{name}:autoscaler` (overwritten at every decision,
    deleted with the service). `qps` is set when the policy scales on request rate,
    `inflight` when it scales on concurrency (`target_ongoing_requests`); `raw`,
    `window_min`, `window_max`, `reason` are `autoscaler.Decision`'s.
    """

    at: float
    policy: str  # `Autoscaler.describe()`
    target: int  # replicas wanted (num_overprovision included)
    raw: int
    window_min: int
    window_max: int
    reason: str
    qps: float | None = None
    inflight: float | None = None
    queue: float | None = None  # engine queue (`target_queue_length_per_replica`)
    kv_usage: float | None = None  # engines' KV usage summed (`target_kv_cache_usage_...`)


class ServiceState(msgspec.Struct, frozen=True, kw_only=True):
    """One service as read in a single MULTI/EXEC: records and snapshot agree."""

    record: ServiceRecord
    replicas: dict[int, ReplicaRecord]
    snapshot: ReadySnapshot | None
    generation: int


def _routable(replicas: Iterable[ReplicaRecord]) -> list[ReplicaRecord]:
    return [r for r in replicas if r.status is ReplicaStatus.READY and r.url is not None]


def _active(record: ServiceRecord, routable: list[ReplicaRecord]) -> tuple[int, ...]:
    counts: dict[int, int] = {}
    for replica in routable:
        counts[replica.version] = counts.get(replica.version, 0) + 1
    if not counts:
        return ()
    match record.update_mode:
        case UpdateMode.ROLLING:
            return tuple(sorted(counts))
        case UpdateMode.BLUE_GREEN:
            for version in sorted(counts, reverse=True):
                if counts[version] >= max(1, record.min_replicas.get(version, 1)):
                    return (version,)
            return (min(counts),)


def compute_active_versions(
    record: ServiceRecord, replicas: Iterable[ReplicaRecord]
) -> tuple[int, ...]:
    """The versions proxies route to, as in Sky Serve.

    rolling: every version with a READY replica. blue_green: the newest version
    with at least its `min_replicas` READY; failing that, the oldest version with
    a READY replica (the one still serving). No READY replica: none.
    """
    return _active(record, _routable(replicas))


def _one_per_url(replicas: list[ReplicaRecord]) -> list[ReplicaRecord]:
    by_url: dict[str | None, ReplicaRecord] = {}
    for replica in replicas:
        seen = by_url.get(replica.url)
        if seen is None or (replica.version, -replica.id) > (seen.version, -seen.id):
            by_url[replica.url] = replica
    return list(by_url.values())


def compute_snapshot(
    record: ServiceRecord,
    replicas: Iterable[ReplicaRecord],
    generation: int,
    now: float,
) -> ReadySnapshot:
    """The ready set of `record` given its replica table: pure, the only definition.

    READY replicas with a URL whose version is active (`compute_active_versions`),
    ordered by id. Two records with one URL (a replica registered twice) yield one
    entry: the newer version, then the lower id.
    """
    routable = _routable(replicas)
    active = _active(record, routable)
    chosen = [r for r in routable if r.version in active]
    if len({r.url for r in chosen}) != len(chosen):
        chosen = _one_per_url(chosen)
    chosen.sort(key=_by_id)
    return ReadySnapshot(
        service=record.name,
        generation=generation,
        published_at=now,
        status=record.status.value,
        policy=record.policy,
        prefix_options=record.prefix_options,
        resume_streams=record.resume_streams,
        active_versions=list(active),
        replicas=tuple(
            ReadyReplica(
                id=r.id,
                url=r.url,
                version=r.version,
                accelerator=r.accelerator,
                target_qps=r.target_qps,
                spot=r.spot,
            )
            for r in chosen
            if r.url is not None
        ),
    )


_by_id = operator.attrgetter("id")
