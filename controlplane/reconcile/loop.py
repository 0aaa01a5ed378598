"""The controller's loop: `Controller` steps every service, commits each plan, then
acts on it (see `controlplane.reconcile` for what one step does).

One attempt at one service: read (`Store.read_state`), gather (the specs of the
versions in the table; the autoscaling signals when a decision may fall due), plan
(`Planner.plan`, no Redis I/O), commit (`Store.commit_with` of `ServicePlan.mutate`;
nothing written when nothing changed), and only then act: start launches and
terminations, append events, write the autoscaler's decision. A conflicting write
since the read (`Stale`) discards the plan and the service is planned again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping

from controlplane.backends.base import ClusterBackend, ReplicaBackend
from controlplane.engines.scraper import EngineScraper
from controlplane.prober import Prober
from controlplane.reconcile.config import ControllerConfig, ReadinessProber, default_backends
from controlplane.reconcile.drain import read_reports
from controlplane.reconcile.engines import scrape_targets
from controlplane.reconcile.journal import Journal
from controlplane.reconcile.planner import Planner
from controlplane.reconcile.scalestate import (
    AutoscalerRegistry,
    ScaleSignals,
    ScaleStep,
    merge_steps,
    read_signals,
    write_step,
)
from controlplane.reconcile.serviceplan import PlanInputs, ServicePlan, Stale
from controlplane.reconcile.tasks import TaskRegistry
from controlplane.records import Handle, ReplicaRecord, ServiceRecord, ServiceState
from controlplane.servicespec import ServiceSpec
from controlplane.states import EventKind, ReplicaStatus, ServiceStatus
from controlplane.store import LeaseLost, Store, StoreError, StoreUnavailable
from proxy.stopping import cancel_requested, stop_tasks

log = logging.getLogger("sluice.controller")

_MAX_REPLANS = 5
#: Seconds the run loop's helper tasks (the nudge listener, the engine scraper) get to end
#: once cancelled; past it they are abandoned, and logged.
STOP_WITHIN = 5.0


class Controller:
    """Reconciles every service in Redis; see `controlplane.reconcile`.

    Drive it with `step()` (tests, with an injected clock) or `run()`. The
    owner calls `start()` first and `aclose()` last; `aclose()` leaves the
    replicas running (for the next leader to adopt) unless
    `config.terminate_on_exit`.
    """

    def __init__(
        self,
        store: Store,
        config: ControllerConfig,
        *,
        clock: Callable[[], float] = time.time,
        backends: Mapping[str, ReplicaBackend] | None = None,
        prober: ReadinessProber | None = None,
    ) -> None:
        self.config = config
        self._store = store
        self._clock = clock
        self._backends: dict[str, ReplicaBackend] = (
            dict(backends) if backends is not None else default_backends(config)
        )
        self._prober: ReadinessProber = (
            prober if prober is not None else Prober(clock=clock, on_result=self.wake)
        )
        self._autoscalers = AutoscalerRegistry(
            interval=config.autoscaler_interval,
            zero_interval=config.autoscaler_zero_interval,
            qps_window=config.qps_window_seconds,
        )
        self._tasks = TaskRegistry(self.wake)
        self.engines = EngineScraper(store, clock=clock)
        self._planner = Planner(
            config, self._backends, self._prober, self._tasks, self._autoscalers
        )
        self._journal = Journal()  # the controller log's line per change
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._specs: dict[tuple[str, float, int], ServiceSpec] = {}
        self._known: set[str] = set()
        # The autoscaler's writes of a step that failed, for the next one that commits.
        self._unwritten: dict[str, ScaleStep] = {}
        # service -> replica id -> (backend, handle) as of the last step: what
        # terminate_all stops when Redis is gone (sluice run's dies with it).
        self._fleet: dict[str, dict[int, tuple[ReplicaBackend, Handle]]] = {}
        # Replica ids recorded per service in this step (for ClusterBackend.sweep).
        self._recorded: dict[str, set[int]] = {}
        self._deadline: float | None = None
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backends and the prober."""
        if self._started:
            return
        for backend in self._backends.values():
            if isinstance(backend, ClusterBackend):
                backend.watch(self.wake)
            await backend.start()
        await self._prober.start()
        await self.engines.start()
        self._started = True

    async def aclose(self, *, stepping_down: bool = False) -> None:
        """Stop launches and terminations in flight, close the prober and backends.

        Replicas keep running unless `config.terminate_on_exit`, in which case
        every replica is terminated (no drain) and its record deleted. A leader
        `stepping_down` (it lost the lease) never terminates: the fleet is the
        service's, and the next leader (possibly this one again) adopts it.
        """
        if self.config.terminate_on_exit and not stepping_down:
            with contextlib.suppress(StoreError):
                await self.terminate_all()
        await self._tasks.aclose()
        await self._prober.aclose()
        await self.engines.aclose()
        for backend in self._backends.values():
            await backend.aclose()
        self._started = False

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def wake(self) -> None:
        """Make `run()` step now (probe results, finished tasks, nudges)."""
        self._wake.set()

    def demand(self, name: str) -> None:
        """A proxy holds requests of `name` with no replica: scale it from zero at once
        (what a "demand" nudge does)."""
        self._autoscalers.note_demand(name)
        self.wake()

    @property
    def autoscalers(self) -> AutoscalerRegistry:
        """The per-service autoscalers (read-only use: tests, diagnostics)."""
        return self._autoscalers

    async def run(self) -> None:
        """Step until cancelled: on every nudge and event, at least every reconcile_interval."""
        await self.start()
        listener = asyncio.create_task(self._listen(), name="controller nudges")
        scraper = asyncio.create_task(self.engines.run(), name="engine telemetry")
        failures = 0
        try:
            while True:
                self._wake.clear()
                try:
                    await self.step()
                    failures = 0
                except (asyncio.CancelledError, LeaseLost):
                    raise  # LeaseLost: a successor leads; run_controller steps down
                except StoreUnavailable as exc:
                    failures += 1
                    log.warning("reconcile step failed: %s", exc)
                except Exception:
                    failures += 1
                    log.exception("reconcile step failed")
                if cancel_requested():
                    # A library under step() turned our cancellation into an error or a
                    # return (redis-py does, in a command cut short): stop anyway, or the
                    # loop idles and steps on, and whoever cancelled it waits for ever.
                    raise asyncio.CancelledError
                if failures:
                    # Probe results keep waking the loop; do not spin on a failing Redis.
                    await asyncio.sleep(min(0.1 * 2**failures, 5.0))
                await self._idle()
        finally:
            # Cancelled again until they end (a library may swallow one cancel), within a
            # bound: a leader stepping down must never wait on them for ever.
            await stop_tasks((listener, scraper), STOP_WITHIN, logger=log)

    async def terminate_all(self) -> None:
        """Terminate every replica this controller can reach (no drain); delete the records.

        A fenced controller that no longer holds the lease terminates nothing but its
        own launches in flight: the fleet is the successor's. When Redis cannot be
        reached (`sluice run`'s private one gets SIGTERM with the controller when
        `sluice run` dies), it terminates the replicas its last steps saw.
        """
        await self._tasks.stop_launches()
        victims = {
            (name, replica_id): known
            for name, replicas in self._fleet.items()
            for replica_id, known in replicas.items()
        }
        records: dict[str, list[ReplicaRecord]] = {}
        try:
            fence = self._store.fence
            # Ours, or free again (it may expire while we shut down): take it for the
            # deletes below. Another's: its holder leads the fleet now.
            if fence is not None and not await self._store.lease(
                fence, self.config.lease_ttl
            ).acquire():
                log.warning("controller %s: not the leader any more; leaving the replicas", fence)
                return
            for name in await self._store.services():
                state = await self._store.read_state(name)
                if state is not None:
                    records[name] = [r for r in state.replicas.values() if r.handle]
                    for r in records[name]:
                        victims[(name, r.id)] = (self._planner.backend(r), r.handle)
        except StoreError as exc:
            # `sluice run`'s private Redis may already be gone (both got SIGTERM when
            # `sluice run` died): stop what the last step saw.
            log.warning("terminating the %d replicas this controller knows of: %s",
                        len(victims), exc)  # fmt: skip
        await asyncio.gather(
            *(backend.terminate(handle) for backend, handle in victims.values()),
            return_exceptions=True,
        )
        self._fleet.clear()
        for name, replicas in records.items():
            with contextlib.suppress(StoreError):
                await self._store.commit(name, replica_deletes=[r.id for r in replicas])

    # -- one step ----------------------------------------------------------------------------

    async def step(self) -> None:
        """Reconcile every service once. Raises the first error after trying them all."""
        async with self._lock:
            self._deadline = None
            self._recorded = {}
            names = await self._store.services()
            first_error: Exception | None = None
            for name in names:
                try:
                    await self._reconcile(name)
                except (asyncio.CancelledError, LeaseLost):
                    raise
                except Exception as exc:
                    log.warning("service %s: reconcile failed: %s", name, exc)
                    first_error = first_error or exc
            self._forget_gone(set(names))
            if first_error is not None:
                raise first_error
            if all(name in self._recorded for name in names):
                for backend in self._backends.values():
                    if isinstance(backend, ClusterBackend):
                        backend.sweep(self._recorded)

    async def _reconcile(self, name: str) -> None:
        # The autoscaler decides at most once per step even when the plan is made again:
        # its writes wait for the commit (or for the last attempt), and for a later
        # step when this one fails.
        scaled = self._unwritten.pop(name, None)
        try:
            if self._autoscalers.trim_due(name, self._clock()):
                # First: at maxmemory (a Redis filled through a proxy's user) Redis
                # refuses commits and even the MULTI of read_state, but not these deletes.
                await self._store.telemetry.enforce_bounds(name)
            for _ in range(_MAX_REPLANS):
                state = await self._store.read_state(name)
                if state is None:
                    self._recorded[name] = set()
                    return
                self._known.add(name)
                plan = self._planner.plan(await self._gather(name, state))
                scaled = merge_steps(scaled, plan.scale)
                if plan.wake_at is not None:
                    self._due(plan.wake_at)
                try:
                    launched = await self._commit(plan)
                except Stale:
                    continue  # an ops command wrote meanwhile: plan again on fresh data
                if not plan.unregister:
                    # Before any await: _after_commit settles the finished launches, and a
                    # cancel (SIGTERM) in its awaits must not leave a committed replica in
                    # neither the launches nor the fleet terminate_all stops without Redis.
                    self._fleet[name] = {
                        r.id: (self._planner.backend(r), r.handle)
                        for r in plan.table.values()
                        if r.handle
                    }
                await self._after_commit(plan, launched)
                if plan.unregister:
                    return
                self._recorded[name] = set(plan.table) | {r.id for r in launched}
                self.engines.track(name, scrape_targets(plan.table.values(), self._specs_of(name)))
                break
            else:
                log.warning("service %s: state kept changing; will retry next step", name)
            if scaled is not None:
                await write_step(self._store, name, scaled, self.config.qps_window_seconds)
        except Exception:
            if scaled is not None:
                self._unwritten[name] = scaled
            raise

    async def _gather(self, name: str, state: ServiceState) -> PlanInputs:
        """Everything the plan needs from Redis: the specs, and the autoscaling signals
        when the autoscaler may decide in this step."""
        record, replicas = state.record, dict(state.replicas)
        now = self._clock()
        latest = await self._spec(record, record.version)
        specs = {record.version: latest}
        for replica in replicas.values():
            if replica.version not in specs:
                specs[replica.version] = await self._spec(record, replica.version)
        signals = ScaleSignals()
        if record.status is not ServiceStatus.SHUTTING_DOWN and self._autoscalers.wants_signals(
            record, now
        ):
            signals = await read_signals(self._store, name, latest.service.scaling, now,
                                         qps_window=self.config.qps_window_seconds)  # fmt: skip
        drain = None
        if any(r.status is ReplicaStatus.SHUTTING_DOWN and r.first_ready_at is not None
               and r.url for r in replicas.values()):  # fmt: skip
            drain = await read_reports(self._store, name, state.generation)
        return PlanInputs(name, record, replicas, specs, signals, now, drain)

    # -- commit and side effects -------------------------------------------------------------

    async def _commit(self, plan: ServicePlan) -> list[ReplicaRecord]:
        """Write the plan in one commit; returns the launched records (ids assigned)."""
        if plan.unregister:
            await self._store.unregister_service(plan.name)
            return []
        if not plan.dirty:
            return []
        return (await self._store.commit_with(plan.name, plan.mutate)).result

    async def _after_commit(self, plan: ServicePlan, launched: list[ReplicaRecord]) -> None:
        name = plan.name
        self._planner.committed(name)
        self._journal.committed(plan)
        self._tasks.settle(name, plan.done_launches, plan.done_terminations)
        for backend, orphan in plan.orphans:
            self._tasks.terminate_orphan(name, backend, orphan)
        if plan.unregister:
            log.info("service %s: unregistered", name)
            self._forget(name)
            return
        # Tasks first: a replica record must never wait on an event write to get its launch.
        for replica in launched:
            spec = await self._spec(plan.record, replica.version)
            backend = self._backends[replica.backend]
            launch = (
                backend.launch(name, replica.id, replica.version, spec, spot=replica.spot)
                if isinstance(backend, ClusterBackend)
                else backend.launch(name, replica.id, replica.version, spec)
            )
            self._tasks.launch(name, replica.id, backend, launch)
            self._journal.launched(name, replica.id, replica.version, replica.backend)
        for replica_id in plan.terminate:
            replica = plan.table[replica_id]
            self._tasks.terminate(
                name, replica_id, self._planner.backend(replica).terminate(replica.handle)
            )
        for replica in launched:
            plan.event(EventKind.LAUNCH, replica=replica.id, version=replica.version,
                       backend=replica.backend)  # fmt: skip
        for kind, fields in plan.events:
            await self._store.append_event(name, kind, fields)

    def _forget_gone(self, names: set[str]) -> None:
        for name in self._known - names:
            self._forget(name)
        self._autoscalers.keep_only(names)
        self._tasks.forget_gone(names)

    def _forget(self, name: str) -> None:
        self._journal.forget(name)
        self._known.discard(name)
        self.engines.forget(name)
        self._fleet.pop(name, None)
        self._unwritten.pop(name, None)
        self._autoscalers.forget(name)
        self._planner.committed(name)
        self._planner.forget(name)
        self._prober.forget_service(name)
        for key in [k for k in self._specs if k[0] == name]:
            del self._specs[key]

    # -- helpers -----------------------------------------------------------------------------

    async def _spec(self, record: ServiceRecord, version: int) -> ServiceSpec:
        key = (record.name, record.created_at, version)
        spec = self._specs.get(key)
        if spec is None:
            raw = await self._store.spec(record.name, version)
            if raw is None:
                raise StoreError(f"service {record.name}: no spec stored for version {version}")
            spec = ServiceSpec.from_json(raw)
            self._specs[key] = spec
        return spec

    def _specs_of(self, name: str) -> dict[int, ServiceSpec]:
        """The cached specs of `name` by version (every version in its table is cached by
        the step's gather)."""
        return {version: spec for (svc, _, version), spec in self._specs.items() if svc == name}

    def _due(self, at: float) -> None:
        if self._deadline is None or at < self._deadline:
            self._deadline = at

    async def _idle(self) -> None:
        timeout = self.config.reconcile_interval
        if self._deadline is not None:
            timeout = min(timeout, max(0.0, self._deadline - self._clock()))
        # Not `asyncio.timeout` + suppress(TimeoutError): on Python 3.11, a cancellation
        # that lands as the timeout expires comes out as TimeoutError, and run() would
        # swallow it and go on stepping (a flood of nudges made that likely).
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((waiter,), timeout=timeout)
        finally:
            waiter.cancel()

    async def _listen(self) -> None:
        """Wake the loop on nudges, at most once per `config.nudge_gap` (a flood of them
        must not make the controller step back to back); resubscribe (with backoff)
        when Redis drops."""
        backoff = 0.1
        gap = self.config.nudge_gap
        loop = asyncio.get_running_loop()
        woke_at = -math.inf
        pending = False  # a nudge arrived inside the gap: wake at its end
        while True:
            try:
                subscription = await self._store.subscribe_control()
                try:
                    backoff = 0.1
                    self.wake()  # anything published while unsubscribed is lost: look now
                    while True:
                        left = woke_at + gap - loop.time()
                        if pending and left <= 0:
                            pending, woke_at = False, loop.time()
                            self.wake()
                        nudge = await subscription.get(timeout=min(5.0, left) if pending else 5.0)
                        if nudge is None:
                            continue
                        if nudge.reason == "demand":
                            self._autoscalers.note_demand(nudge.service)
                        if loop.time() - woke_at >= gap:
                            pending, woke_at = False, loop.time()
                            self.wake()
                        else:
                            pending = True
                finally:
                    await subscription.aclose()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("control channel: %s; resubscribing in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
