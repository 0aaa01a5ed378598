"""The only control-plane code that reads or writes sluice's Redis keys.

The keys are named once, in proxy/wire/keys.py (`Keys`, with the table of them).

The ready set changes only through `Store.commit`: under WATCH on the service
record, the replica table and the generation, it reads them, applies the change,
computes the snapshot with `models.compute_snapshot`, and in one MULTI/EXEC
writes the records, INCRs the generation, SETs the snapshot and PUBLISHes it. A
concurrent writer aborts the EXEC and the commit retries on fresh data, so two
writers never interleave and a reader (`read_state`, one MULTI/EXEC) never sees
records and snapshot disagree.

Fencing: a store built with `fence=HOLDER` (the controller's) also WATCHes the
leader lease and reads it with the records; unless the lease holds HOLDER, the
commit raises LeaseLost and writes nothing, and a lease taken over between the
read and the EXEC aborts the EXEC. So a leader paused past its lease (GC, SIGSTOP,
a slow VM) cannot commit once a successor holds the lease.

Ambiguous commits: when the connection drops after EXEC was sent, redis-py raises
WatchError although the EXEC may have been applied. Each transaction therefore
SETs `{p}:op:{id}` (a random id, one per call, kept 60 s) in its MULTI/EXEC, and a
retry that finds the key returns instead of applying the change a second time.

The generation lives in Redis: run Redis with persistence (AOF) in production.
A Redis that restarts empty restarts generations at 1; proxies notice (their
GET answers a generation below the one they hold) and follow it.

Ops scripts: `redis-cli GET sluice:svc:NAME:snapshot` prints the ready set;
`redis-cli PUBLISH sluice:control NAME` asks the controller to reconcile NAME.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import types
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from controlplane.models import (
    AutoscalerStatus,
    Event,
    ReplicaRecord,
    ServiceRecord,
    ServiceState,
    compute_snapshot,
)
from controlplane.states import ServiceStatus
from proxy.redisurl import client_from_url, redis_tls_options
from proxy.wire.errors import SluiceError, SnapshotInvalid
from proxy.wire.keys import DEFAULT_PREFIX, Keys
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot, encode_snapshot
from proxy.wire.telemetry import InflightEntry, Nudge, ProxyHeartbeat, decode_nudge, encode_nudge

log = logging.getLogger("sluice.store")

# Pause after a lost WATCH race: uniform in [0, min(max, min * 2**attempt)] seconds.
_RETRY_PAUSE_MIN = 0.0005
_RETRY_PAUSE_MAX = 0.02
# How long a transaction's applied-marker lives: far longer than one commit call lasts
# (its retries included), short enough that the markers stay few.
_OP_TTL_MS = 60_000


class StoreError(SluiceError):
    """A Redis operation of the store failed.

    StoreError
    ├── StoreUnavailable   Redis unreachable or timed out
    ├── ServiceNotFound    no such service
    ├── ServiceExists      register_service of a name already taken
    ├── CommitConflict     too many concurrent writers; the commit gave up
    ├── LeaseLost          a fenced commit found the leader lease held by another
    └── RecordInvalid      a record in Redis does not decode
    """


class StoreUnavailable(StoreError):
    """Redis could not be reached, or did not answer in time."""


class ServiceNotFound(StoreError):
    """The service has no record in Redis."""


class ServiceExists(StoreError):
    """A service of that name is already registered."""


class CommitConflict(StoreError):
    """The commit lost the WATCH race too many times in a row."""


class LeaseLost(StoreError):
    """A fenced store's commit found the leader lease gone or held by someone else."""


class RecordInvalid(StoreError):
    """A record stored in Redis failed to decode (written by hand, or corrupt)."""


# -- the service record as a hash ------------------------------------------------------------


def _is_text(tp: Any) -> bool:
    """True for field types stored raw in the hash: str, str enums, and their optionals."""
    if isinstance(tp, types.UnionType):
        return all(_is_text(arg) for arg in tp.__args__)
    return tp is type(None) or (isinstance(tp, type) and issubclass(tp, str))


# name -> JSON decoder for that field's type, or None when the field is stored raw.
_SERVICE_FIELDS: dict[str, msgspec.json.Decoder[Any] | None] = {
    f.encode_name: None if _is_text(f.type) else msgspec.json.Decoder(f.type)
    for f in msgspec.structs.fields(ServiceRecord)
}
_ENCODER = msgspec.json.Encoder()
_REPLICA_DECODER = msgspec.json.Decoder(ReplicaRecord)
_INFLIGHT_DECODER = msgspec.json.Decoder(InflightEntry)
_HEARTBEAT_DECODER = msgspec.json.Decoder(ProxyHeartbeat)
_AUTOSCALER_DECODER = msgspec.json.Decoder(AutoscalerStatus)


def encode_service_record(record: ServiceRecord) -> dict[str, bytes]:
    """Hash fields of a record: strings raw, other values JSON, None fields left out."""
    fields: dict[str, bytes] = {}
    for name, value in msgspec.structs.asdict(record).items():
        if value is None:
            continue
        fields[name] = value.encode() if isinstance(value, str) else _ENCODER.encode(value)
    return fields


def decode_service_record(fields: Mapping[bytes | str, bytes | str]) -> ServiceRecord:
    """Inverse of `encode_service_record`; unknown fields are ignored. Raises RecordInvalid."""
    values: dict[str, Any] = {}
    try:
        for raw_name, raw in fields.items():
            name = _text(raw_name)
            if name not in _SERVICE_FIELDS:
                continue  # written by a newer controller
            decoder = _SERVICE_FIELDS[name]
            values[name] = _text(raw) if decoder is None else decoder.decode(raw)
        return msgspec.convert(values, ServiceRecord)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise RecordInvalid(f"service record {values.get('name', '?')!r}: {exc}") from exc


def _text(value: bytes | str) -> str:
    # The store's own clients answer bytes; a caller's client may decode responses.
    return value.decode() if isinstance(value, bytes) else value


def _decode_replica(name: str, raw_id: bytes | str, raw: bytes | str) -> ReplicaRecord:
    try:
        return _REPLICA_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecordInvalid(f"service {name}: replica {_text(raw_id)!r}: {exc}") from exc


def _decode_replicas(name: str, raw: Mapping[bytes | str, bytes | str]) -> dict[int, ReplicaRecord]:
    table = {}
    for raw_id, value in raw.items():
        replica = _decode_replica(name, raw_id, value)
        table[replica.id] = replica
    return dict(sorted(table.items()))


# -- leader lease scripts --------------------------------------------------------------------

_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class _Change(NamedTuple):
    """What one attempt of a transaction writes, planned from the state it read."""

    record: ServiceRecord
    upserts: tuple[ReplicaRecord, ...] = ()
    deletes: tuple[int, ...] = ()
    # Further writes queued in the same MULTI after the commit's own.
    extra: Callable[[Any], None] | None = None


# Given the record (None: absent) and the raw replica table read under WATCH, plan a change.
_Planner = Callable[[ServiceRecord | None, Mapping[bytes, bytes]], _Change]


class Mutation(NamedTuple):
    """What a `Store.commit_with` plan writes: as `Store.commit`'s arguments, plus specs
    (version -> spec JSON) stored in the same MULTI/EXEC."""

    replica_updates: tuple[ReplicaRecord, ...] = ()
    replica_deletes: tuple[int, ...] = ()
    service_record: ServiceRecord | None = None
    specs: Mapping[int, bytes] = {}


R = TypeVar("R")

#: Given the service record and replica table as they are under WATCH: what to write, and
#: what the caller learns from it (e.g. the id it gave a new replica; None when nothing).
MutationPlan = Callable[[ServiceRecord, dict[int, ReplicaRecord]], tuple[Mutation, R]]


@dataclass(frozen=True, slots=True)
class Committed(Generic[R]):
    """What `Store.commit_with` returns: the snapshot after the commit and the result of
    the plan run that was written."""

    snapshot: ReadySnapshot
    result: R


class Store:
    """Typed access to sluice's Redis state for the controller, the CLI and ops scripts.

    Wraps a `redis.asyncio.Redis` (bytes responses, i.e. `decode_responses=False`).
    Use `Store.from_url(url)` to have the store own (and close) its client:

        async with Store.from_url("redis://127.0.0.1:6379/0") as store:
            snapshot = await store.commit("svc", replica_updates=[replica])

    Every method raises StoreUnavailable when Redis is unreachable, StoreError for
    other Redis failures.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
        owns_client: bool = False,
        max_commit_attempts: int = 100,
        fence: str | None = None,
    ) -> None:
        """`fence`: a lease holder id; every commit then requires that it holds the leader
        lease (the controller's store; ops commands use an unfenced one)."""
        self.keys = Keys(prefix)
        self.fence = fence
        self._redis = client
        self._clock = clock
        self._owns_client = owns_client
        self._max_commit_attempts = max_commit_attempts
        # service -> {record JSON: record} of its table at the last commit (see _attempt).
        self._decoded: dict[str, dict[bytes, ReplicaRecord]] = {}
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
        socket_timeout: float = 10.0,
        ca_file: str | None = None,
        fence: str | None = None,
    ) -> Store:
        """A store with its own client for `url` (redis://, rediss://, unix://,
        redis+sentinel://; see `proxy.redisurl`); no I/O yet. A malformed URL raises
        RedisURLError (a ValueError) naming what is wrong. `ca_file`: the CA that signed
        a rediss:// server's certificate (None: the system's); raises ConfigError when
        given for a URL without TLS."""
        client = client_from_url(
            url,
            socket_connect_timeout=socket_timeout,
            socket_timeout=socket_timeout,
            # A couple of quick retries ride over a dropped idle connection; a Redis
            # that is really down surfaces as StoreUnavailable within about a second.
            retry=Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.05), 2),
            **redis_tls_options(url, ca_file),
        )
        return cls(client, prefix=prefix, clock=clock, owns_client=True, fence=fence)

    async def aclose(self) -> None:
        """Close the client if the store owns it."""
        if self._owns_client:
            await self._redis.aclose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        # The one boundary where redis-py's errors become the store's.
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(f"redis unavailable: {exc}") from exc
        except RedisError as exc:
            raise StoreError(f"redis error: {exc}") from exc

    async def ping(self) -> None:
        """Round-trip to Redis; raises StoreUnavailable when it does not answer."""
        with self._errors():
            await self._redis.ping()

    # -- reads -------------------------------------------------------------------------------

    async def services(self) -> list[str]:
        """Names of all registered services, sorted."""
        with self._errors():
            names = await self._redis.smembers(self.keys.services)
        return sorted(_text(n) for n in names)

    async def service(self, name: str) -> ServiceRecord | None:
        """The service record, or None if the service is not registered."""
        with self._errors():
            fields = await self._redis.hgetall(self.keys.service(name))
        return decode_service_record(fields) if fields else None

    async def replicas(self, name: str) -> dict[int, ReplicaRecord]:
        """The replica table of a service, by id (ascending); empty if none."""
        with self._errors():
            raw = await self._redis.hgetall(self.keys.replicas(name))
        return _decode_replicas(name, raw)

    async def replica(self, name: str, replica_id: int) -> ReplicaRecord | None:
        """One replica record, or None."""
        with self._errors():
            raw = await self._redis.hget(self.keys.replicas(name), str(replica_id))
        return None if raw is None else _decode_replica(name, str(replica_id), raw)

    async def spec(self, name: str, version: int) -> bytes | None:
        """The spec JSON of one version of a service, as stored; None if absent."""
        with self._errors():
            raw = await self._redis.get(self.keys.spec(name, version))
        return None if raw is None else raw.encode() if isinstance(raw, str) else raw

    async def snapshot(self, name: str) -> ReadySnapshot | None:
        """The latest committed ReadySnapshot, or None. Raises SnapshotInvalid if corrupt."""
        with self._errors():
            raw = await self._redis.get(self.keys.snapshot(name))
        return None if raw is None else decode_snapshot(raw)

    async def generation(self, name: str) -> int:
        """The service's current generation (0 before the first commit)."""
        with self._errors():
            raw = await self._redis.get(self.keys.gen(name))
        return int(raw or 0)

    async def read_state(self, name: str) -> ServiceState | None:
        """Record, replicas, snapshot and generation read in one MULTI/EXEC (consistent).

        None if the service is not registered.
        """
        k = self.keys
        with self._errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(k.service(name))
                pipe.hgetall(k.replicas(name))
                pipe.get(k.snapshot(name))
                pipe.get(k.gen(name))
                raw_record, raw_replicas, raw_snapshot, raw_gen = await pipe.execute()
        if not raw_record:
            return None
        return ServiceState(
            record=decode_service_record(raw_record),
            replicas=_decode_replicas(name, raw_replicas),
            snapshot=None if raw_snapshot is None else decode_snapshot(raw_snapshot),
            generation=int(raw_gen or 0),
        )

    # -- the one writer of the ready set -----------------------------------------------------

    async def commit(
        self,
        service: str,
        *,
        replica_updates: Iterable[ReplicaRecord] = (),
        replica_deletes: Iterable[int] = (),
        service_record: ServiceRecord | None = None,
        force: bool = False,
    ) -> ReadySnapshot:
        """Atomically write replica records and the service record, and publish the ready set.

        `replica_updates` are written whole (upsert by id); `replica_deletes` are
        removed; `service_record`, if given, replaces the stored one (its
        `active_versions` is recomputed). In the same MULTI/EXEC the snapshot is
        recomputed from the resulting table; if it routes differently from the
        stored one (or `force`), the generation is INCRed and the snapshot SET and
        PUBLISHed. Otherwise only the records are written and the stored snapshot
        is returned: probe counters and the like do not churn generations.

        Returns the snapshot in force after the commit. Raises ServiceNotFound if
        the service is not registered, ValueError on contradictory arguments,
        CommitConflict after `max_commit_attempts` lost WATCH races.
        """
        upserts = _validated(service, replica_updates)
        deletes = tuple(dict.fromkeys(replica_deletes))
        ids = [r.id for r in upserts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"service {service}: replica_updates repeat an id: {sorted(ids)}")
        if set(ids) & set(deletes):
            raise ValueError(
                f"service {service}: replicas both updated and deleted: "
                f"{sorted(set(ids) & set(deletes))}"
            )
        if service_record is not None and service_record.name != service:
            raise ValueError(f"service_record is for {service_record.name!r}, not {service!r}")

        def plan(current: ServiceRecord | None, _table: Mapping[bytes, bytes]) -> _Change:
            if current is None:
                raise ServiceNotFound(f"no service {service!r}")
            return _Change(service_record or current, upserts, deletes)

        return await self._transact(service, plan, force=force)

    async def commit_with(
        self, service: str, plan: MutationPlan[R], *, force: bool = False
    ) -> Committed[R]:
        """Read-modify-write commit: `plan` gets the record and replica table as read under
        WATCH and returns the Mutation to write (atomically, as `commit` does) with a
        result, which is returned with the new snapshot.

        When another writer gets in first, `plan` runs again on fresh data, so it must
        be free of side effects; the result returned is the one of the run whose Mutation
        was written. An exception `plan` raises propagates (nothing written).
        Raises ServiceNotFound, ValueError on a contradictory Mutation, CommitConflict.
        """
        k = self.keys
        results: list[R] = []  # the result of the latest plan run

        def planner(current: ServiceRecord | None, table: Mapping[bytes, bytes]) -> _Change:
            if current is None:
                raise ServiceNotFound(f"no service {service!r}")
            mutation, result = plan(current, _decode_replicas(service, dict(table.items())))
            results[:] = [result]
            upserts = _validated(service, mutation.replica_updates)
            deletes = tuple(dict.fromkeys(mutation.replica_deletes))
            ids = [r.id for r in upserts]
            if len(set(ids)) != len(ids) or set(ids) & set(deletes):
                raise ValueError(f"service {service}: a mutation repeats replica ids {ids}")
            record = mutation.service_record or current
            if record.name != service:
                raise ValueError(f"service_record is for {record.name!r}, not {service!r}")
            specs = dict(mutation.specs)

            def extra(pipe: Any) -> None:
                for version, spec in specs.items():
                    pipe.set(k.spec(service, version), spec)

            return _Change(record, upserts, deletes, extra if specs else None)

        snapshot = await self._transact(service, planner, force=force)
        return Committed(snapshot, results[0])

    async def register_service(self, record: ServiceRecord, spec: bytes | str) -> ReadySnapshot:
        """Create a service: its record, the spec of `record.version`, membership in the
        services set and a first (empty) snapshot, in one MULTI/EXEC.

        `created_at` is set from the store's clock when 0. Raises ServiceExists.
        """
        name = record.name
        if not record.created_at:
            record = msgspec.structs.replace(record, created_at=self._clock())
        spec_bytes = spec.encode() if isinstance(spec, str) else spec
        k = self.keys

        def extra(pipe: Any) -> None:
            pipe.sadd(k.services, name)
            pipe.set(k.spec(name, record.version), spec_bytes)

        def plan(current: ServiceRecord | None, table: Mapping[bytes, bytes]) -> _Change:
            if current is not None:
                raise ServiceExists(f"service {name!r} already exists")
            # Leftovers of a half-removed service must not leak into the new one.
            stale = tuple(int(raw_id) for raw_id in table)
            return _Change(record, (), stale, extra)

        return await self._transact(name, plan, force=True)

    async def put_spec(self, name: str, version: int, spec: bytes | str) -> None:
        """Store the spec JSON of one version (write it before committing that version)."""
        with self._errors():
            await self._redis.set(self.keys.spec(name, version), spec)

    async def unregister_service(self, name: str) -> ReadySnapshot:
        """Remove a service: publish a final empty SHUTTING_DOWN snapshot and delete its
        keys, in one MULTI/EXEC. The snapshot and the generation counter stay, so a
        proxy that reconnects later learns the service is gone, and a service
        re-registered under the same name continues the generations.

        Raises ServiceNotFound.
        """
        k = self.keys

        def plan(current: ServiceRecord | None, table: Mapping[bytes, bytes]) -> _Change:
            if current is None:
                raise ServiceNotFound(f"no service {name!r}")
            versions = range(1, current.version + 1)

            def extra(pipe: Any) -> None:
                pipe.srem(k.services, name)
                pipe.delete(
                    k.service(name),
                    k.replicas(name),
                    k.rps(name),
                    k.inflight(name),
                    k.autoscaler(name),
                    k.events(name),
                    *(k.spec(name, v) for v in versions),
                )

            final = msgspec.structs.replace(current, status=ServiceStatus.SHUTTING_DOWN)
            return _Change(final, (), tuple(int(raw_id) for raw_id in table), extra)

        return await self._transact(name, plan, force=True)

    async def _transact(self, name: str, plan: _Planner, *, force: bool) -> ReadySnapshot:
        k = self.keys
        op_id = uuid.uuid4().hex  # one per call: its retries carry the same id
        watched = [k.service(name), k.replicas(name), k.gen(name)]
        if self.fence is not None:
            watched.append(k.leader)
        with self._errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                for attempt in range(self._max_commit_attempts):
                    try:
                        await pipe.watch(*watched)
                        return await self._attempt(pipe, name, plan, force, op_id)
                    except WatchError:
                        # Another writer got in first, or the connection dropped (maybe
                        # after our EXEC was applied: the next attempt looks). Plan again
                        # on fresh data, after a jittered pause so that racing writers
                        # fall out of lockstep (without it one can lose every round).
                        ceiling = min(_RETRY_PAUSE_MAX, _RETRY_PAUSE_MIN * 2**attempt)
                        await asyncio.sleep(random.uniform(0, ceiling))
        raise CommitConflict(
            f"service {name}: commit lost {self._max_commit_attempts} WATCH races in a row"
        )

    async def _attempt(
        self, pipe: Any, name: str, plan: _Planner, force: bool, op_id: str
    ) -> ReadySnapshot:
        k = self.keys
        # Read on another connection: anything written after the WATCH above aborts
        # our EXEC, so these reads need no transaction of their own (one round trip).
        async with self._redis.pipeline(transaction=False) as reads:
            reads.hgetall(k.service(name))
            reads.hgetall(k.replicas(name))
            reads.get(k.gen(name))
            reads.get(k.snapshot(name))
            reads.exists(k.op(op_id))
            if self.fence is not None:
                reads.get(k.leader)
            raw_record, raw_table, raw_gen, raw_snapshot, applied, *lease = await reads.execute()
        if applied:
            # An earlier attempt's EXEC was applied but its reply was lost.
            await pipe.unwatch()
            if raw_snapshot is None:
                raise ServiceNotFound(f"no service {name!r}")
            return decode_snapshot(raw_snapshot)
        if self.fence is not None and (not lease[0] or _text(lease[0]) != self.fence):
            await pipe.unwatch()
            holder = _text(lease[0]) if lease[0] else "nobody"
            raise LeaseLost(f"service {name}: commit refused: the leader lease is {holder}'s, "
                            f"not {self.fence}'s")  # fmt: skip
        current = decode_service_record(raw_record) if raw_record else None
        change = plan(current, raw_table)
        touched = {str(i).encode() for i in change.deletes}
        touched.update(str(r.id).encode() for r in change.upserts)
        # Records about to be overwritten or deleted are not decoded: a corrupt one can
        # be repaired by a commit that replaces it. The others mostly did not change since
        # the last commit: reuse their decoded records, keyed by their JSON.
        known = self._decoded.get(name, {})
        decoded: dict[bytes, ReplicaRecord] = {}
        for raw_id, raw in raw_table.items():
            if raw_id not in touched:
                replica = known.get(raw)
                decoded[raw] = replica or _decode_replica(name, raw_id, raw)
        table = list(decoded.values())
        table.extend(change.upserts)
        encoded = {r.id: _ENCODER.encode(r) for r in change.upserts}
        snapshot = compute_snapshot(change.record, table, int(raw_gen or 0) + 1, self._clock())
        record = msgspec.structs.replace(
            change.record, active_versions=tuple(snapshot.active_versions)
        )
        payload = encode_snapshot(snapshot)
        unchanged = None if force else _same_ready_set(raw_snapshot, payload, snapshot)

        pipe.multi()
        if change.deletes:
            pipe.hdel(k.replicas(name), *(str(i) for i in change.deletes))
        if change.upserts:
            pipe.hset(k.replicas(name), mapping={str(i): raw for i, raw in encoded.items()})
        pipe.delete(k.service(name))
        pipe.hset(k.service(name), mapping=encode_service_record(record))
        if unchanged is None:
            pipe.incr(k.gen(name))
            pipe.set(k.snapshot(name), payload)
            pipe.publish(k.ready(name), payload)
        if change.extra is not None:
            change.extra(pipe)
        pipe.set(k.op(op_id), b"1", px=_OP_TTL_MS)
        await pipe.execute()
        decoded.update((encoded[r.id], r) for r in change.upserts)
        self._decoded[name] = decoded
        return snapshot if unchanged is None else unchanged

    # -- events, request rates, lease, nudges -----------------------------------------------

    async def append_event(
        self,
        name: str,
        kind: str,
        fields: Mapping[str, str | int | float] | None = None,
        *,
        maxlen: int = 10_000,
    ) -> str:
        """Append an audit event to the service's stream (trimmed to about `maxlen`).

        Returns the entry id.
        """
        entry: dict[Any, Any] = {"kind": kind, "at": self._clock()}
        for key, value in (fields or {}).items():
            if key in entry:
                raise ValueError(f"event field {key!r} is reserved")
            entry[key] = value
        with self._errors():
            entry_id = await self._redis.xadd(
                self.keys.events(name), entry, maxlen=maxlen, approximate=True
            )
        return _text(entry_id)

    async def events(self, name: str, count: int = 100) -> list[Event]:
        """The latest `count` events of a service, oldest first."""
        with self._errors():
            entries = await self._redis.xrevrange(self.keys.events(name), count=count)
        events = []
        for entry_id, raw in reversed(entries or []):
            data = {_text(key): _text(value) for key, value in (raw or {}).items()}
            events.append(
                Event(
                    id=_text(entry_id or b""),
                    kind=data.pop("kind", ""),
                    at=float(data.pop("at", 0.0)),
                    fields=data,
                )
            )
        return events

    async def read_rps(self, name: str) -> dict[int, int]:
        """Request counts per unix second, as flushed by the proxies (all proxies summed).

        A field that is not an integer second with an integer count (written by hand,
        or by something that is not a sluice proxy) is skipped and logged.
        """
        with self._errors():
            raw = await self._redis.hgetall(self.keys.rps(name))
        counts = {}
        for second, count in raw.items():
            parsed = _int(second), _int(count)
            if parsed[0] is None or parsed[1] is None:
                log.warning("service %s: ignoring a malformed rps field %r=%r", name,
                            second, count)  # fmt: skip
                continue
            counts[parsed[0]] = parsed[1]
        return dict(sorted(counts.items()))

    async def trim_rps(self, name: str, before: int) -> int:
        """Delete request counts of seconds earlier than `before`, and fields that are not
        an integer second (logged); returns how many were deleted."""
        key = self.keys.rps(name)
        with self._errors():
            seconds = await self._redis.hkeys(key)
            old = []
            for raw in seconds:
                second = _int(raw)
                if second is None:
                    log.warning("service %s: deleting a malformed rps field %r", name, raw)
                if second is None or second < before:
                    old.append(raw)
            if not old:
                return 0
            deleted: int = await self._redis.hdel(key, *old)
        return deleted

    async def read_inflight(self, name: str) -> dict[str, InflightEntry]:
        """Every proxy's in-flight counts (proxy id -> entry); stale ones included, the
        caller judges freshness by `at`. An entry that fails to decode is skipped."""
        with self._errors():
            raw = await self._redis.hgetall(self.keys.inflight(name))
        entries = {}
        for proxy_id, value in raw.items():
            try:
                entries[_text(proxy_id)] = _INFLIGHT_DECODER.decode(value)
            except (msgspec.ValidationError, msgspec.DecodeError):
                log.warning("service %s: ignoring an invalid in-flight entry", name)
        return entries

    async def read_proxies(
        self, name: str, *, stale_after: float = 30.0
    ) -> dict[str, ProxyHeartbeat]:
        """Every live proxy's heartbeat (proxy id -> ProxyHeartbeat), sorted by id.

        Entries not refreshed for `stale_after` seconds are proxies that stopped:
        they are deleted here, so the hash holds about one entry per live proxy process
        (a live one whose entry raced the delete writes it again within a second). An
        entry that fails to decode is skipped.
        """
        key = self.keys.proxies(name)
        now = self._clock()
        with self._errors():
            raw = await self._redis.hgetall(key)
        beats: dict[str, ProxyHeartbeat] = {}
        stale: list[bytes | str] = []
        for proxy_id, value in raw.items():
            try:
                beat = _HEARTBEAT_DECODER.decode(value)
            except (msgspec.ValidationError, msgspec.DecodeError):
                log.warning("service %s: ignoring an invalid proxy heartbeat", name)
                continue
            if now - beat.seen_at > stale_after:
                stale.append(proxy_id)
            else:
                beats[_text(proxy_id)] = beat
        if stale:
            with self._errors():
                await self._redis.hdel(key, *stale)
        return dict(sorted(beats.items()))

    async def write_autoscaler(self, name: str, status: AutoscalerStatus) -> None:
        """Record the controller's last autoscaling decision (for `sluice status`)."""
        with self._errors():
            await self._redis.set(self.keys.autoscaler(name), _ENCODER.encode(status))

    async def read_autoscaler(self, name: str) -> AutoscalerStatus | None:
        """The controller's last autoscaling decision, or None (none yet, or unreadable)."""
        with self._errors():
            raw = await self._redis.get(self.keys.autoscaler(name))
        if raw is None:
            return None
        try:
            return _AUTOSCALER_DECODER.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    async def acquire_lease(self, holder: str, ttl: float) -> bool:
        """Take the controller leader lease for `ttl` seconds if free, or extend it if
        `holder` already has it. True when `holder` holds it afterwards."""
        with self._errors():
            got = await self._acquire(keys=[self.keys.leader], args=[holder, _ms(ttl)])
        return bool(got)

    async def renew_lease(self, holder: str, ttl: float) -> bool:
        """Extend the lease to `ttl` seconds from now, only if `holder` holds it."""
        with self._errors():
            got = await self._renew(keys=[self.keys.leader], args=[holder, _ms(ttl)])
        return bool(got)

    async def release_lease(self, holder: str) -> bool:
        """Give the lease up, only if `holder` holds it. True if it was released."""
        with self._errors():
            got = await self._release(keys=[self.keys.leader], args=[holder])
        return bool(got)

    async def lease_holder(self) -> str | None:
        """Who holds the leader lease now, or None."""
        with self._errors():
            raw = await self._redis.get(self.keys.leader)
        return None if raw is None else _text(raw)

    async def follow_snapshots(
        self, name: str, *, resync_interval: float = 5.0, subscribe_timeout: float = 5.0
    ) -> AsyncGenerator[ReadySnapshot, None]:
        """Yield the current snapshot of `name` (if any), then each newer one as committed.

        Reads the way a proxy does: subscribe to the ready channel first, then GET
        the snapshot key, yield only generations above the last one yielded, and GET
        again every `resync_interval` (pub/sub is at-most-once). A payload that does
        not decode is skipped. Runs until the consumer stops iterating; raises
        StoreUnavailable when Redis cannot be reached or the connection drops.
        """
        pubsub = self._redis.pubsub()
        current = -1
        loop = asyncio.get_running_loop()
        try:
            with self._errors():
                await pubsub.subscribe(self.keys.ready(name))
                # GET only once the server has registered the subscription, so that no
                # commit falls between the two.
                try:
                    async with asyncio.timeout(subscribe_timeout):
                        while True:
                            message = await pubsub.get_message(timeout=subscribe_timeout)
                            if message is not None and message["type"] == "subscribe":
                                break
                except TimeoutError as exc:
                    raise StoreUnavailable("redis unavailable: no subscribe confirmation") from exc
            next_resync = loop.time()
            while True:
                payload: bytes | str | None = None
                with self._errors():
                    if loop.time() >= next_resync:
                        payload = await self._redis.get(self.keys.snapshot(name))
                        next_resync = loop.time() + resync_interval
                    else:
                        wait = max(0.0, next_resync - loop.time())
                        message = await pubsub.get_message(timeout=wait)
                        if message is not None and message["type"] == "message":
                            payload = message["data"]
                if payload is None:
                    continue
                try:
                    snapshot = decode_snapshot(payload)
                except SnapshotInvalid:
                    continue  # a bad payload changes nothing; the next one may be fine
                if snapshot.generation > current:
                    current = snapshot.generation
                    yield snapshot
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def subscribe_control(self) -> ControlSubscription:
        """Subscribe to the control channel (nudges); the caller closes the subscription."""
        pubsub = self._redis.pubsub()
        with self._errors():
            try:
                await pubsub.subscribe(self.keys.control)
            except BaseException:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                raise
        return ControlSubscription(pubsub, self._errors)

    async def nudge(self, name: str, reason: str = "changed") -> int:
        """Ask the controller to reconcile `name` now. Returns how many listeners got it."""
        with self._errors():
            receivers: int = await self._redis.publish(
                self.keys.control, encode_nudge(Nudge(service=name, reason=reason))
            )
        return receivers


class ControlSubscription:
    """Nudges arriving on the control channel (from `Store.subscribe_control`).

    Pub/sub is at-most-once: a nudge only makes the controller act sooner, it
    reconciles on its own interval anyway.
    """

    def __init__(
        self, pubsub: Any, errors: Callable[[], contextlib.AbstractContextManager[None]]
    ) -> None:
        self._pubsub = pubsub
        self._errors = errors

    async def get(self, timeout: float) -> Nudge | None:  # noqa: ASYNC109 (redis-py's own)
        """The next nudge, or None if none arrives within `timeout` seconds.

        A message that is not a nudge is logged and skipped (None).
        """
        with self._errors():
            message = await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(0.0, timeout)
            )
        if message is None or message.get("type") != "message":
            return None
        try:
            return decode_nudge(message["data"])
        except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
            log.warning("ignoring an invalid nudge: %s", exc)
            return None

    async def aclose(self) -> None:
        """Unsubscribe and release the connection."""
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()


def _int(raw: bytes | str) -> int | None:
    """An integer field or value of a hash, or None when it is not one."""
    try:
        return int(raw)
    except ValueError:
        return None


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError(f"lease ttl must be > 0, got {seconds}")
    return max(1, round(seconds * 1000))


class _Routing(msgspec.Struct):
    """What of a stored snapshot decides routing; the replicas left as raw JSON."""

    service: str
    generation: int
    published_at: float
    status: str = ""
    policy: str = ""
    active_versions: list[int] = []
    replicas: msgspec.Raw = msgspec.Raw(b"[]")
    prefix_options: dict[str, Any] | None = None


_ROUTING_DECODER = msgspec.json.Decoder(_Routing)


def _same_ready_set(
    stored: bytes | None, payload: bytes, snapshot: ReadySnapshot
) -> ReadySnapshot | None:
    """The stored snapshot if it routes exactly like `snapshot` (encoded as `payload`).

    Compares the replicas as raw JSON instead of decoding them: at 1,000 replicas,
    building ReadyReplica objects would be most of a commit's CPU.
    """
    if stored is None:
        return None
    try:
        old = _ROUTING_DECODER.decode(stored)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None  # corrupt: this commit replaces it
    new = _ROUTING_DECODER.decode(payload)
    if (old.service, old.status, old.policy, old.active_versions, old.prefix_options) != (
        new.service,
        new.status,
        new.policy,
        new.active_versions,
        new.prefix_options,
    ) or bytes(old.replicas) != bytes(new.replicas):
        return None
    return msgspec.structs.replace(
        snapshot, generation=old.generation, published_at=old.published_at
    )


def _validated(name: str, replicas: Iterable[ReplicaRecord]) -> tuple[ReplicaRecord, ...]:
    """Round-trip records through JSON so their constraints (the URL) are checked now."""
    records = []
    for replica in replicas:
        try:
            records.append(_REPLICA_DECODER.decode(_ENCODER.encode(replica)))
        except msgspec.ValidationError as exc:
            raise ValueError(f"service {name}: replica {replica.id}: {exc}") from exc
    return tuple(records)
