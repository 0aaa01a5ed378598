"""The controller's autoscaling state: one `Autoscaler` per service (the
`AutoscalerRegistry`), fed with the proxies' per-second request counts or in-flight
totals (`ScaleSignals`).

One step of a service, in three parts so that planning does no I/O:

1. `read_signals` (before planning): the signals the service's autoscaler will
   need in this step (`AutoscalerRegistry.wants_signals`), or none. The rps hash
   is trimmed to the QPS window before it is read, which bounds the read.
2. `AutoscalerRegistry.observe` (while planning; no I/O): creates the service's
   Autoscaler from the latest spec's replica policy the first time it sees the
   service, `reset`s it whenever the service record's version changes (an
   update), calls `demand()` when a proxy signalled that it holds requests with
   no replica (a "demand" nudge, `note_demand`), and otherwise decides every
   `autoscaler.interval` seconds. It returns a `ScaleStep`: the target (None for
   services without autoscaling: the fixed count, `rollout.target_replicas`),
   when the autoscaler next wants a step, and what to write.
3. `write_step` (after the commit): each decision is written to the store
   (`{prefix}:svc:{name}:autoscaler`, an `AutoscalerStatus`) for `sluice status`,
   and every `RPS_TRIM_INTERVAL_SECONDS` the service's rps hash is trimmed to the
   QPS window, whether or not the service autoscales on QPS. As often, first thing
   in the service's step (before any read in MULTI or commit, which Redis refuses
   at maxmemory), each hash proxies write that is over its bounds is deleted
   (`trim_due`, `store.telemetry.enforce_bounds`).

The decisions live in this process only: a controller that takes over starts from
the number of replicas it finds running, not from zero.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.autoscaler import (
    DECISION_INTERVAL_SECONDS,
    NO_REPLICA_DECISION_INTERVAL_SECONDS,
    QPS_WINDOW_SECONDS,
    Autoscaler,
    Decision,
)
from controlplane.records import AutoscalerStatus, ReplicaRecord, ServiceRecord
from controlplane.servicespec import ReplicaPolicy, ServiceSpec
from controlplane.states import LIVE
from controlplane.store import Store

log = logging.getLogger("sluice.scaling")

#: An in-flight entry older than this (proxy gone or stuck) is not counted.
INFLIGHT_FRESH_SECONDS = 3.0
#: An engine record older than this (scrapes failing) is not counted.
ENGINE_FRESH_SECONDS = 5.0
#: Proxies' clocks ahead of the controller's by more than this: their in-flight
#: entries are not counted, their request counts are trimmed.
MAX_CLOCK_SKEW_SECONDS = 60
#: Every service's rps hash is trimmed to the QPS window at least this often, whether
#: or not it autoscales on QPS (proxies write one field per second regardless).
RPS_TRIM_INTERVAL_SECONDS = 10.0
#: At most this many services with a pending "demand" nudge (names are checked
#: against the registered services at every step; more are dropped).
MAX_PENDING_DEMAND = 1024


@dataclass(frozen=True, slots=True)
class ScaleSignals:
    """What the proxies reported, read before planning: per-second request counts
    (QPS policies) or the fresh in-flight total (concurrency policies)."""

    rps: dict[int, int] | None = None
    inflight: float | None = None
    queue: float | None = None  # requests waiting in the engines (queue-length policies)
    kv_usage: float | None = None  # the engines' KV usage summed (KV-usage policies)


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """What `observe` made of one step: the autoscaler's target (None: not autoscaled,
    the fixed count applies), when it next wants a step, and the writes for after the
    commit (a decision to record; whether to trim the rps hash)."""

    target: int | None
    due: float
    now: float  # the step's time
    status: AutoscalerStatus | None = None
    trim: bool = False


@dataclass
class _Service:
    autoscaler: Autoscaler
    version: tuple[float, int]  # (created_at, version) of the policy it follows
    due: float  # the next decision
    trim_due: float = 0.0  # the next trim of the rps hash


class AutoscalerRegistry:
    """Per-service autoscalers for one controller; see the module docstring."""

    def __init__(
        self,
        *,
        interval: float = DECISION_INTERVAL_SECONDS,
        zero_interval: float = NO_REPLICA_DECISION_INTERVAL_SECONDS,
        qps_window: int = QPS_WINDOW_SECONDS,
    ) -> None:
        self._interval = interval
        self._zero_interval = zero_interval
        self.qps_window = qps_window
        self._services: dict[str, _Service] = {}
        self._demand: set[str] = set()

    def note_demand(self, name: str) -> None:
        """A proxy holds requests of `name` with no replica: scale it from zero next step.

        Anyone who can publish on the control channel can send any name: at most
        MAX_PENDING_DEMAND are kept, and `keep_only` drops those of no service.
        """
        if name in self._demand or len(self._demand) < MAX_PENDING_DEMAND:
            self._demand.add(name)
        else:
            log.warning("dropping a demand nudge for %r: %d already pending", name[:100],
                        len(self._demand))  # fmt: skip

    def keep_only(self, names: set[str]) -> None:
        """Forget pending demand for anything but these (the registered services)."""
        self._demand &= names

    @property
    def pending_demand(self) -> frozenset[str]:
        """Services with a demand nudge not yet acted on (diagnostics, tests)."""
        return frozenset(self._demand)

    def forget(self, name: str) -> None:
        self._services.pop(name, None)
        self._demand.discard(name)

    def _new(
        self,
        policy: ReplicaPolicy,
        record: ServiceRecord,
        managed: Sequence[ReplicaRecord],
        now: float,
    ) -> _Service:
        autoscaler = Autoscaler(
            policy,
            now=now,
            current=_adopted(policy, record, managed),
            interval=self._interval,
            zero_interval=self._zero_interval,
            qps_window=self.qps_window,
        )
        return _Service(autoscaler, (record.created_at, record.version), due=now)

    def trim_due(self, name: str, now: float) -> bool:
        """Whether this step trims the service's rps hash (and so polices the bounds of
        every hash its proxies write; see the module docstring)."""
        service = self._services.get(name)
        return service is None or now >= service.trim_due

    def wants_signals(self, record: ServiceRecord, now: float) -> bool:
        """Whether `observe` may decide (or reset) in a step at `now`: then the signals
        are read before planning."""
        service = self._services.get(record.name)
        return (
            service is None
            or service.version != (record.created_at, record.version)
            or now >= service.due
        )

    def observe(
        self,
        record: ServiceRecord,
        spec: ServiceSpec,
        managed: Sequence[ReplicaRecord],
        signals: ScaleSignals,
        now: float,
    ) -> ScaleStep:
        """Bring the service's autoscaler up to date (no I/O); see the module docstring.

        `managed`: the replicas the controller runs (external ones excluded).
        `signals`: what `read_signals` read for this step.
        """
        name = record.name
        policy = spec.service.scaling
        version = (record.created_at, record.version)
        service = self._services.get(name)
        demand = name in self._demand
        self._demand.discard(name)
        decision: Decision | None = None
        if service is None:
            service = self._services[name] = self._new(policy, record, managed, now)
        elif service.version != version:
            decision = service.autoscaler.reset(
                policy, now, rps=signals.rps, inflight=signals.inflight, queue=signals.queue,
                kv_usage=signals.kv_usage,
            )
            service.version = version
            service.due = now + service.autoscaler.interval
        trim = now >= service.trim_due
        if trim:
            # Seconds before the window are never read again; nothing else trims them.
            service.trim_due = now + RPS_TRIM_INTERVAL_SECONDS
        autoscaler = service.autoscaler
        if demand and autoscaler.autoscaling and autoscaler.current == 0:
            decision = autoscaler.demand(now)
            service.due = now + autoscaler.interval
        if now >= service.due:
            replica_qps, fastest = _capacity(policy, record, managed)
            decision = autoscaler.decide(
                now,
                rps=signals.rps,
                inflight=signals.inflight,
                replica_qps=replica_qps,
                fastest_qps=fastest,
                queue=signals.queue,
                kv_usage=signals.kv_usage,
            )
            service.due = now + autoscaler.interval
        return ScaleStep(
            target=autoscaler.target if autoscaler.autoscaling else None,
            due=service.due,
            now=now,
            status=_status(autoscaler, decision, now) if decision is not None else None,
            trim=trim,
        )


async def read_signals(
    store: Store, name: str, policy: ReplicaPolicy, now: float, *, qps_window: int
) -> ScaleSignals:
    """The signals `policy` scales on, as the proxies (or the engines) last reported them."""
    on_kv = policy.target_kv_cache_usage_per_replica is not None
    if policy.target_queue_length_per_replica is not None or on_kv:
        view = await store.telemetry.read_engines(name)
        stats = view.replicas.values() if view is not None else ()
        live = [s for s in stats if now - s.at <= ENGINE_FRESH_SECONDS]
        if on_kv:
            return ScaleSignals(kv_usage=sum(s.kv_usage or 0.0 for s in live))
        return ScaleSignals(queue=float(sum(s.queue for s in live)))
    if policy.target_ongoing_requests is not None:
        entries = await store.telemetry.read_inflight(name)
        # An entry from the future (beyond clock skew) would stay "fresh" forever.
        fresh = [e.total for e in entries.values()
                 if -MAX_CLOCK_SKEW_SECONDS <= now - e.at <= INFLIGHT_FRESH_SECONDS]  # fmt: skip
        return ScaleSignals(inflight=float(sum(fresh)))
    if policy.target_qps_per_replica is None:
        return ScaleSignals()
    # Part of the read, as it bounds it: seconds before the window are never read again.
    # (Only the proxies' counters are touched; the controller's state is not.)
    until = int(now) + MAX_CLOCK_SKEW_SECONDS
    await store.telemetry.trim_rps(name, int(now) - qps_window - 1, until)
    return ScaleSignals(rps=await store.telemetry.read_rps(name))


async def write_step(store: Store, name: str, step: ScaleStep, qps_window: int) -> None:
    """After the commit: record the decision, trim the rps hash to the QPS window."""
    if step.trim:
        await store.telemetry.trim_rps(
            name, int(step.now) - qps_window - 1, int(step.now) + MAX_CLOCK_SKEW_SECONDS
        )
    if step.status is not None:
        await store.telemetry.write_autoscaler(name, step.status)


def merge_steps(earlier: ScaleStep | None, later: ScaleStep | None) -> ScaleStep | None:
    """The writes of two attempts at one step (or of a failed step and the next): the
    latest decision, and a trim if either wanted one."""
    if earlier is None or later is None:
        return later or earlier
    status = later.status if later.status is not None else earlier.status
    return ScaleStep(later.target, later.due, later.now, status, earlier.trim or later.trim)


def _latest_live(record: ServiceRecord, managed: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
    return [r for r in managed if r.status in LIVE and r.version == record.version]


def _adopted(
    policy: ReplicaPolicy, record: ServiceRecord, managed: Sequence[ReplicaRecord]
) -> int | None:
    """The current target of a service first seen with replicas running (a controller
    taking over): what runs, within bounds. None (min_replicas) when nothing runs."""
    live = len(_latest_live(record, managed)) - policy.num_overprovision
    if live <= 0:
        return None
    hi = policy.max_replicas if policy.max_replicas is not None else policy.min_replicas
    return max(policy.min_replicas, min(hi, live))


def _capacity(
    policy: ReplicaPolicy, record: ServiceRecord, managed: Sequence[ReplicaRecord]
) -> tuple[list[float], float | None]:
    """Instance-aware: each live replica's QPS (its accelerator's) and the fastest's."""
    match policy.target_qps_per_replica:
        case dict() as table:
            fastest = max(table.values())
            return [
                r.target_qps
                if r.target_qps is not None
                else (policy.target_qps_for(r.accelerator) or fastest)
                for r in _latest_live(record, managed)
            ], fastest
    return [], None


def _status(autoscaler: Autoscaler, decision: Decision, now: float) -> AutoscalerStatus:
    policy = autoscaler.policy
    on_inflight = policy.target_ongoing_requests is not None
    on_qps = policy.target_qps_per_replica is not None
    on_queue = policy.target_queue_length_per_replica is not None
    on_kv = policy.target_kv_cache_usage_per_replica is not None
    return AutoscalerStatus(
        at=now,
        policy=autoscaler.describe(),
        target=decision.target,
        raw=decision.raw,
        window_min=decision.window_min,
        window_max=decision.window_max,
        reason=decision.reason,
        qps=decision.signal if on_qps else None,
        inflight=decision.signal if on_inflight else None,
        queue=decision.signal if on_queue else None,
        kv_usage=decision.signal if on_kv else None,
    )
