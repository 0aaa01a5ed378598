"""The one writer of the ready set: the WATCH/MULTI/EXEC transaction behind
`Store.commit`, `commit_with`, `register_service` and `unregister_service`.

Under WATCH on the service record, the replica table and the generation (and the
leader lease, for a fenced store), one attempt reads them, plans the change, computes
the snapshot with `records.compute_snapshot`, and in one MULTI/EXEC writes the
records, INCRs the generation, SETs the snapshot and PUBLISHes it (unless the ready
set did not change: `codec.same_ready_set`). A concurrent writer aborts the EXEC and
the transaction runs again on fresh data.

Fencing: with `fence=HOLDER` an attempt that reads the lease held by someone else
raises LeaseLost and writes nothing; a lease taken over between the read and the
EXEC aborts the EXEC.

Ambiguous commits: each transaction SETs `{p}:op:{id}` (one random id per call, kept
60 s) in its MULTI/EXEC; an attempt that finds it returns instead of applying the
change a second time (the connection dropped after an EXEC that was applied).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from controlplane.errors import (
    CommitConflict,
    LeaseLost,
    ServiceExists,
    ServiceNotFound,
    redis_errors,
)
from controlplane.records import ReplicaRecord, ServiceRecord, compute_snapshot
from controlplane.states import ServiceStatus
from controlplane.store.codec import (
    ENCODER,
    decode_replica,
    decode_replicas,
    decode_service_record,
    encode_service_record,
    same_ready_set,
    text,
    validated,
)
from proxy.wire.keys import Keys
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot, encode_snapshot

# Pause after a lost WATCH race: uniform in [0, min(max, min * 2**attempt)] seconds.
_RETRY_PAUSE_MIN = 0.0005
_RETRY_PAUSE_MAX = 0.02
# How long a transaction's applied-marker lives: far longer than one commit call lasts
# (its retries included), short enough that the markers stay few.
_OP_TTL_MS = 60_000


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


class _Change(NamedTuple):
    """What one attempt of a transaction writes, planned from the state it read."""

    record: ServiceRecord
    upserts: tuple[ReplicaRecord, ...] = ()
    deletes: tuple[int, ...] = ()
    # Further writes queued in the same MULTI after the commit's own.
    extra: Callable[[Any], None] | None = None


# Given the record (None: absent) and the raw replica table read under WATCH, plan a change.
_Planner = Callable[[ServiceRecord | None, Mapping[bytes, bytes]], _Change]


class _Read(NamedTuple):
    """What one attempt reads under WATCH (raw, as Redis answered)."""

    record: Mapping[bytes | str, bytes | str]
    table: Mapping[bytes, bytes]
    generation: bytes | None
    snapshot: bytes | None
    applied: int
    lease: bytes | None  # the lease holder; None also when the store is not fenced


class Transactions:
    """The store's transactions on one client; see the module docstring.

    `fence`: a lease holder id every commit requires (None: unfenced).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        clock: Callable[[], float],
        *,
        max_attempts: int,
        fence: str | None,
    ) -> None:
        self._redis = client
        self._keys = keys
        self._clock = clock
        self._max_attempts = max_attempts
        self._fence = fence
        # service -> {record JSON: record} of its table at the last commit (see _reuse).
        self._decoded: dict[str, dict[bytes, ReplicaRecord]] = {}

    async def commit(
        self,
        service: str,
        replica_updates: Iterable[ReplicaRecord],
        replica_deletes: Iterable[int],
        service_record: ServiceRecord | None,
        force: bool,
    ) -> ReadySnapshot:
        """`Store.commit`: check the arguments, then write them in one transaction."""
        upserts = validated(service, replica_updates)
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

        return await self.transact(service, plan, force=force)

    async def commit_with(self, service: str, plan: MutationPlan[R], force: bool) -> Committed[R]:
        """`Store.commit_with`: run `plan` on the state read under WATCH, write its Mutation."""
        k = self._keys
        results: list[R] = []  # the result of the latest plan run

        def planner(current: ServiceRecord | None, table: Mapping[bytes, bytes]) -> _Change:
            if current is None:
                raise ServiceNotFound(f"no service {service!r}")
            mutation, result = plan(current, decode_replicas(service, dict(table.items())))
            results[:] = [result]
            upserts = validated(service, mutation.replica_updates)
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

        snapshot = await self.transact(service, planner, force=force)
        return Committed(snapshot, results[0])

    async def register(self, record: ServiceRecord, spec: bytes) -> ReadySnapshot:
        """`Store.register_service` (`record.created_at` already set)."""
        name = record.name
        k = self._keys

        def extra(pipe: Any) -> None:
            pipe.sadd(k.services, name)
            pipe.set(k.spec(name, record.version), spec)

        def plan(current: ServiceRecord | None, table: Mapping[bytes, bytes]) -> _Change:
            if current is not None:
                raise ServiceExists(f"service {name!r} already exists")
            # Leftovers of a half-removed service must not leak into the new one.
            stale = tuple(int(raw_id) for raw_id in table)
            return _Change(record, (), stale, extra)

        return await self.transact(name, plan, force=True)

    async def unregister(self, name: str) -> ReadySnapshot:
        """`Store.unregister_service`."""
        k = self._keys

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
                    k.engines(name),
                    k.events(name),
                    *(k.spec(name, v) for v in versions),
                )

            final = msgspec.structs.replace(current, status=ServiceStatus.SHUTTING_DOWN)
            return _Change(final, (), tuple(int(raw_id) for raw_id in table), extra)

        return await self.transact(name, plan, force=True)

    async def transact(self, name: str, plan: _Planner, *, force: bool) -> ReadySnapshot:
        """Run attempts until one's EXEC goes through; raises CommitConflict after
        `max_attempts` lost WATCH races."""
        k = self._keys
        op_id = uuid.uuid4().hex  # one per call: its retries carry the same id
        watched = [k.service(name), k.replicas(name), k.gen(name)]
        if self._fence is not None:
            watched.append(k.leader)
        with redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                for attempt in range(self._max_attempts):
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
            f"service {name}: commit lost {self._max_attempts} WATCH races in a row"
        )

    async def _attempt(
        self, pipe: Any, name: str, plan: _Planner, force: bool, op_id: str
    ) -> ReadySnapshot:
        """One attempt under WATCH: read; return at once if an earlier attempt of this call
        was applied; check the fence; plan; compute the snapshot; queue every write in one
        MULTI and EXEC it (WatchError when another writer got in first)."""
        read = await self._read(name, op_id)
        if read.applied:
            # An earlier attempt's EXEC was applied but its reply was lost.
            await pipe.unwatch()
            if read.snapshot is None:
                raise ServiceNotFound(f"no service {name!r}")
            return decode_snapshot(read.snapshot)
        if self._fence is not None and (not read.lease or text(read.lease) != self._fence):
            await pipe.unwatch()
            holder = text(read.lease) if read.lease else "nobody"
            raise LeaseLost(f"service {name}: commit refused: the leader lease is {holder}'s, "
                            f"not {self._fence}'s")  # fmt: skip
        current = decode_service_record(read.record) if read.record else None
        change = plan(current, read.table)
        decoded = self._reuse(name, read.table, change)
        table = list(decoded.values())
        table.extend(change.upserts)
        encoded = {r.id: ENCODER.encode(r) for r in change.upserts}
        snapshot = compute_snapshot(
            change.record, table, int(read.generation or 0) + 1, self._clock()
        )
        record = msgspec.structs.replace(
            change.record, active_versions=tuple(snapshot.active_versions)
        )
        payload = encode_snapshot(snapshot)
        unchanged = None if force else same_ready_set(read.snapshot, payload, snapshot)
        pipe.multi()
        self._queue(pipe, name, change, record, encoded)
        if unchanged is None:
            pipe.incr(self._keys.gen(name))
            pipe.set(self._keys.snapshot(name), payload)
            pipe.publish(self._keys.ready(name), payload)
        if change.extra is not None:
            change.extra(pipe)
        pipe.set(self._keys.op(op_id), b"1", px=_OP_TTL_MS)
        await pipe.execute()
        decoded.update((encoded[r.id], r) for r in change.upserts)
        self._decoded[name] = decoded
        return snapshot if unchanged is None else unchanged

    async def _read(self, name: str, op_id: str) -> _Read:
        k = self._keys
        # Read on another connection: anything written after the WATCH aborts our EXEC,
        # so these reads need no transaction of their own (one round trip).
        async with self._redis.pipeline(transaction=False) as reads:
            reads.hgetall(k.service(name))
            reads.hgetall(k.replicas(name))
            reads.get(k.gen(name))
            reads.get(k.snapshot(name))
            reads.exists(k.op(op_id))
            if self._fence is not None:
                reads.get(k.leader)
            raw_record, raw_table, raw_gen, raw_snapshot, applied, *lease = await reads.execute()
        holder = lease[0] if lease else None
        return _Read(raw_record, raw_table, raw_gen, raw_snapshot, applied, holder)

    def _reuse(
        self, name: str, raw_table: Mapping[bytes, bytes], change: _Change
    ) -> dict[bytes, ReplicaRecord]:
        """The records of the table that `change` keeps, decoded: {record JSON: record}.

        Records about to be overwritten or deleted are not decoded: a corrupt one can be
        repaired by a commit that replaces it. The others mostly did not change since the
        last commit: their decoded records are reused, keyed by their JSON.
        """
        touched = {str(i).encode() for i in change.deletes}
        touched.update(str(r.id).encode() for r in change.upserts)
        known = self._decoded.get(name, {})
        decoded: dict[bytes, ReplicaRecord] = {}
        for raw_id, raw in raw_table.items():
            if raw_id not in touched:
                replica = known.get(raw)
                decoded[raw] = replica or decode_replica(name, raw_id, raw)
        return decoded

    def _queue(
        self,
        pipe: Any,
        name: str,
        change: _Change,
        record: ServiceRecord,
        encoded: Mapping[int, bytes],
    ) -> None:
        """Queue the record writes of `change` (in MULTI): replica deletes and upserts,
        and the service record replaced whole."""
        k = self._keys
        if change.deletes:
            pipe.hdel(k.replicas(name), *(str(i) for i in change.deletes))
        if change.upserts:
            pipe.hset(k.replicas(name), mapping={str(i): raw for i, raw in encoded.items()})
        pipe.delete(k.service(name))
        pipe.hset(k.service(name), mapping=encode_service_record(record))
