"""`Poller`: the dashboard's one reader of Redis, and the memory every page is served from.

Every `interval` (1 s) one `step()` reads every service (`ops.status`, the same view
`sluice status` prints, plus the events, request counts, in-flight counts and, when the
store has them, engine views), encodes the fleet document and each service's stream
message once, and appends one sample per service to a ring buffer (`history` samples, 10 min
at 1 s). Pages and the event stream read only these: N open dashboards cost Redis what
one does, and a page's request never waits on Redis.

Readers wait for the next step with `wait(seq)`, which returns the new sequence number
(one asyncio.Condition, notified once per step). Redis being down is not fatal: the last
documents stay, marked stale with the error, and the loop tries again next tick.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Mapping

import msgspec

from controlplane import ops
from controlplane.dashboard.model import (
    JSON,
    Reading,
    Scalar,
    engine_scalars,
    fleet_row,
    sample,
    service_doc,
)
from controlplane.dashboard.rates import RateTracker
from controlplane.records import Event
from controlplane.store import ServiceNotFound, Store, StoreError
from proxy.stopping import cancel_requested
from proxy.wire.errors import SluiceError

log = logging.getLogger("sluice.dashboard")

#: Samples kept per service: 10 minutes at one per second.
DEFAULT_HISTORY = 600
#: Events read per service per step (the timeline shows these).
EVENTS_SHOWN = 100
#: Events read per service per step once the latest EVENTS_SHOWN are kept.
EVENTS_PEEK = 10
#: Seconds of request counts read per service per step (the newest whole one is 2 s old).
RPS_SECONDS = 4
#: Services read at once in a step (each read is a few round trips to Redis).
READ_CONCURRENCY = 8
#: Autoscaler decisions remembered per service (they are not in the event stream).
DECISIONS_KEPT = 50

_ENCODER = msgspec.json.Encoder()


def _stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a comparable pair ((0, 0) if malformed)."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


class Poller:
    """Reads the fleet once per `interval` and keeps what the pages show."""

    def __init__(
        self,
        store: Store,
        *,
        interval: float = 1.0,
        history: int = DEFAULT_HISTORY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.interval = interval
        self._history_len = history
        self._clock = clock
        self._cond = asyncio.Condition()
        self._concurrency = asyncio.Semaphore(READ_CONCURRENCY)
        self._task: asyncio.Task[None] | None = None
        self.seq = 0  # steps completed
        self.error: str | None = None  # the last step's failure, None when it succeeded
        self.fleet: bytes = _ENCODER.encode({"services": [], "at": 0.0, "error": None})
        self.docs: dict[str, JSON] = {}  # name -> service document (no history)
        self.latest: dict[str, bytes] = {}  # name -> encoded {"doc", "sample"} (the stream)
        self.history: dict[str, collections.deque[JSON]] = {}
        self._decisions: dict[str, collections.deque[JSON]] = {}
        self._events_kept: dict[str, list[Event]] = {}
        self._rates = RateTracker()  # errors/s and routing reasons from the heartbeats

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="sluice-dashboard-poller")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def run(self) -> None:
        """Step every `interval` until cancelled (a step's failure is kept, not raised)."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop's one broad except: log, go on
                log.exception("dashboard poll failed")
            if cancel_requested():  # redis-py turned our cancel into an error: stop anyway
                raise asyncio.CancelledError
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def wait(self, seq: int, timeout: float) -> int:  # noqa: ASYNC109
        """Wait until a step after `seq` completed (or `timeout`); the current seq."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.seq > seq), timeout)
            except TimeoutError:
                pass
            return self.seq

    # -- one step ----------------------------------------------------------------------------

    async def step(self) -> None:
        """Read every service once and publish the documents (Redis errors are kept)."""
        now = self._clock()
        try:
            names = await self._store.services()
            # Every read finishes (none is left running unawaited); the first error wins.
            found = await asyncio.gather(*(self._bounded_read(name) for name in names),
                                         return_exceptions=True)  # fmt: skip
            for result in found:
                if isinstance(result, BaseException):
                    raise result
            readings = [r for r in found if isinstance(r, Reading)]
        except (StoreError, SluiceError, ValueError) as exc:
            # Redis down, or a record or spec that does not decode (SpecError, a
            # ValueError): keep what was read last, and say why it is not fresh.
            if str(exc) != self.error:
                log.warning("dashboard: cannot read the fleet: %s", exc)
            self.error = str(exc) or type(exc).__name__
            self.fleet = self._stale_fleet(now)
        else:
            self.error = None
            self._publish(readings, now)
        async with self._cond:
            self.seq += 1
            self._cond.notify_all()

    async def _bounded_read(self, name: str) -> Reading | None:
        """`sluice status`'s view of `name` and the rest (None: removed since the listing)."""
        async with self._concurrency:
            try:
                views = await ops.status(self._store, name)
            except ServiceNotFound:
                return None
            return await self._read(views[0])

    async def _read(self, view: ops.ServiceView) -> Reading:
        name = view.name
        store = self._store
        events = await self._events(name)
        # The last few seconds only: the hash holds up to an hour of them.
        second = int(self._clock())
        rps = await store.telemetry.read_rps_seconds(name, range(second - RPS_SECONDS, second + 1))
        inflight = await store.telemetry.read_inflight(name)
        beats = await store.telemetry.read_proxies(name)
        return Reading(view=view, events=events, rps=rps, inflight=inflight,
                       engines=await self._engines(name),
                       rates=self._rates.update(name, beats, self._clock()))  # fmt: skip

    async def _events(self, name: str) -> list[Event]:
        """The latest EVENTS_SHOWN events: the last few read and joined to those kept,
        unless more arrived since the last step than that read covers (then all again)."""
        kept = self._events_kept.get(name)
        if kept:
            recent = await self._store.events(name, EVENTS_PEEK)
            last = _stream_id(kept[-1].id)
            if not recent or _stream_id(recent[0].id) <= last:
                kept = [*kept, *(e for e in recent if _stream_id(e.id) > last)][-EVENTS_SHOWN:]
                self._events_kept[name] = kept
                return kept
        kept = await self._store.events(name, EVENTS_SHOWN)
        self._events_kept[name] = kept
        return kept

    async def _engines(self, name: str) -> dict[int, dict[str, Scalar]]:
        """The service's engine view by replica (empty when none is published): a read
        that fails or an entry that is not a scalar mapping shows nothing, never an error.

        `store.telemetry.read_engines(name)` answers None or a view whose `replicas` maps
        replica id -> stats; stats are Structs or mappings of scalars."""
        try:
            raw: object = await self._store.telemetry.read_engines(name)
        except StoreError:
            return {}
        per_replica = getattr(raw, "replicas", raw)
        if not isinstance(per_replica, Mapping):
            return {}
        out: dict[int, dict[str, Scalar]] = {}
        for key, value in per_replica.items():
            try:
                rid = int(key)
            except (TypeError, ValueError):
                continue
            scalars = engine_scalars(value)
            if scalars:
                out[rid] = scalars
        return out

    def _publish(self, readings: list[Reading], now: float) -> None:
        names = {r.view.name for r in readings}
        for gone in set(self.history) - names:
            del self.history[gone]
            self._decisions.pop(gone, None)
            self._events_kept.pop(gone, None)
            self._rates.forget(gone)
        fleet: list[JSON] = []
        docs: dict[str, JSON] = {}
        latest: dict[str, bytes] = {}
        for reading in readings:
            name = reading.view.name
            point = sample(reading, now)
            self.history.setdefault(name, collections.deque(maxlen=self._history_len)).append(
                point
            )
            doc = service_doc(reading, now)
            doc["decisions"] = list(self._decision_log(reading))
            fleet.append(fleet_row(reading, now))
            docs[name] = doc
            latest[name] = _ENCODER.encode({"doc": doc, "sample": point})
        self.docs, self.latest = docs, latest
        self.fleet = _ENCODER.encode({"services": fleet, "at": now, "error": None})

    def service_body(self, name: str) -> bytes | None:
        """The service page's first load: its document with the whole chart history
        (encoded per request, not per step: streams carry one sample at a time)."""
        doc = self.docs.get(name)
        if doc is None:
            return None
        return _ENCODER.encode({**doc, "history": list(self.history.get(name, ()))})

    def _decision_log(self, reading: Reading) -> collections.deque[JSON]:
        """The autoscaler's decisions seen so far (it keeps only its last one in Redis)."""
        kept = self._decisions.setdefault(
            reading.view.name, collections.deque(maxlen=DECISIONS_KEPT)
        )
        decision = reading.view.autoscaler
        # It rewrites the same decision every reconcile: keep the changes only.
        if decision is not None and (
            not kept or (kept[-1]["target"], kept[-1]["reason"]) != (decision.target,
                                                                      decision.reason)
        ):
            kept.append(msgspec.to_builtins(decision))
        return kept

    def _stale_fleet(self, now: float) -> bytes:
        previous = msgspec.json.decode(self.fleet)
        return _ENCODER.encode({**previous, "error": self.error, "checked_at": now})
