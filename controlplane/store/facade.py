"""`Store`: typed access to sluice's Redis state, the one object the controller, the CLI
and ops scripts use. The reads of the records and the audit events are here (one Redis
call each), the writes of the ready set delegate to commit.py; the telemetry and the
leader lease are bound objects with their own scripts: `store.telemetry`
(controlplane/store/telemetry.py) and `store.lease(holder, ttl)` (controlplane/lease.py).

The keys are named once, in proxy/wire/keys.py (`Keys`, with the table of them).

The ready set changes only through `commit` (and `commit_with`, `register_service`,
`unregister_service`): one WATCH/MULTI/EXEC transaction (controlplane/store/commit.py)
writes the records, the new snapshot (generation = INCR) and its PUBLISH together, so
two writers never interleave and a reader (`read_state`, one MULTI/EXEC) never sees
records and snapshot disagree. A store built with `fence=HOLDER` (the controller's)
commits only while HOLDER holds the leader lease (controlplane/lease.py).

The generation lives in Redis: run Redis with persistence (AOF) in production.
A Redis that restarts empty restarts generations at 1; proxies notice (their
GET answers a generation below the one they hold) and follow it.

Ops scripts: `redis-cli GET sluice:svc:NAME:snapshot` prints the ready set;
`redis-cli PUBLISH sluice:control NAME` asks the controller to reconcile NAME.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

import controlplane.store.pubsub as pubsub
from controlplane.errors import StoreUnavailable, redis_errors
from controlplane.lease import Lease
from controlplane.records import (
    Event,
    ReplicaRecord,
    ServiceRecord,
    ServiceState,
)
from controlplane.store.codec import decode_replica, decode_replicas, decode_service_record, text
from controlplane.store.commit import Committed, MutationPlan, R, Transactions
from controlplane.store.pubsub import ControlSubscription
from controlplane.store.telemetry import Telemetry
from controlplane.store.untrusted import Rejects
from proxy.redisurl import client_from_url, redis_tls_options
from proxy.wire.feed import NoSubscribeConfirmation, newer_snapshots
from proxy.wire.keys import DEFAULT_PREFIX, Keys
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot


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
        self._transactions = Transactions(
            client, self.keys, clock, max_attempts=max_commit_attempts, fence=fence
        )
        #: What proxies wrote that was skipped, by (service, kind) (untrusted.py).
        self.rejects = Rejects()
        #: Request rates, in-flight counts, heartbeats, engine views, autoscaling
        #: decisions (controlplane/store/telemetry.py).
        self.telemetry = Telemetry(client, self.keys, clock, self.rejects)

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

    async def ping(self) -> None:
        """Round-trip to Redis; raises StoreUnavailable when it does not answer."""
        with redis_errors():
            await self._redis.ping()

    # -- reads -------------------------------------------------------------------------------

    async def services(self) -> list[str]:
        """Names of all registered services, sorted."""
        with redis_errors():
            names = await self._redis.smembers(self.keys.services)
        return sorted(text(n) for n in names)

    async def service(self, name: str) -> ServiceRecord | None:
        """The service record, or None if the service is not registered."""
        with redis_errors():
            fields = await self._redis.hgetall(self.keys.service(name))
        return decode_service_record(fields) if fields else None

    async def replicas(self, name: str) -> dict[int, ReplicaRecord]:
        """The replica table of a service, by id (ascending); empty if none."""
        with redis_errors():
            raw = await self._redis.hgetall(self.keys.replicas(name))
        return decode_replicas(name, raw)

    async def replica(self, name: str, replica_id: int) -> ReplicaRecord | None:
        """One replica record, or None."""
        with redis_errors():
            raw = await self._redis.hget(self.keys.replicas(name), str(replica_id))
        return None if raw is None else decode_replica(name, str(replica_id), raw)

    async def spec(self, name: str, version: int) -> bytes | None:
        """The spec JSON of one version of a service, as stored; None if absent."""
        with redis_errors():
            raw = await self._redis.get(self.keys.spec(name, version))
        return None if raw is None else raw.encode() if isinstance(raw, str) else raw

    async def snapshot(self, name: str) -> ReadySnapshot | None:
        """The latest committed ReadySnapshot, or None. Raises SnapshotInvalid if corrupt."""
        with redis_errors():
            raw = await self._redis.get(self.keys.snapshot(name))
        return None if raw is None else decode_snapshot(raw)

    async def generation(self, name: str) -> int:
        """The service's current generation (0 before the first commit)."""
        with redis_errors():
            raw = await self._redis.get(self.keys.gen(name))
        return int(raw or 0)

    async def read_state(self, name: str) -> ServiceState | None:
        """Record, replicas, snapshot and generation read in one MULTI/EXEC (consistent).

        None if the service is not registered.
        """
        k = self.keys
        with redis_errors():
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
            replicas=decode_replicas(name, raw_replicas),
            snapshot=None if raw_snapshot is None else decode_snapshot(raw_snapshot),
            generation=int(raw_gen or 0),
        )

    # -- the one writer of the ready set (commit.py) ----------------------------------------

    async def commit(
        self,
        service: str,
        *,
        replica_updates: Iterable[ReplicaRecord] = (),
        replica_deletes: Iterable[int] = (),
        service_record: ServiceRecord | None = None,
        force: bool = False,
    ) -> ReadySnapshot:
        """Atomically write replica records and the service record, and publish the ready set
        (the transaction is controlplane/store/commit.py's).

        `replica_updates` are written whole (upsert by id); `replica_deletes` are
        removed; `service_record`, if given, replaces the stored one (its
        `active_versions` is recomputed). A new generation only when the ready set
        routes differently (or `force`): probe counters and the like do not churn
        generations.

        Returns the snapshot in force after the commit. Raises ServiceNotFound if
        the service is not registered, ValueError on contradictory arguments,
        CommitConflict after `max_commit_attempts` lost WATCH races.
        """
        return await self._transactions.commit(
            service, replica_updates, replica_deletes, service_record, force
        )

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
        return await self._transactions.commit_with(service, plan, force)

    async def register_service(self, record: ServiceRecord, spec: bytes | str) -> ReadySnapshot:
        """Create a service: its record, the spec of `record.version`, membership in the
        services set and a first (empty) snapshot, in one MULTI/EXEC.

        `created_at` is set from the store's clock when 0. Raises ServiceExists.
        """
        if not record.created_at:
            record = msgspec.structs.replace(record, created_at=self._clock())
        spec_bytes = spec.encode() if isinstance(spec, str) else spec
        return await self._transactions.register(record, spec_bytes)

    async def unregister_service(self, name: str) -> ReadySnapshot:
        """Remove a service: publish a final empty SHUTTING_DOWN snapshot and delete its
        keys, in one MULTI/EXEC. The snapshot and the generation counter stay, so a
        proxy that reconnects later learns the service is gone, and a service
        re-registered under the same name continues the generations.

        Raises ServiceNotFound.
        """
        return await self._transactions.unregister(name)

    # -- the audit events ------------------------------------------------------------------

    async def append_event(
        self,
        name: str,
        kind: str,
        fields: Mapping[str, str | int | float] | None = None,
        *,
        maxlen: int = 10_000,
    ) -> str:
        """Append an audit event (at the store's clock's time) to the service's stream,
        trimmed to about `maxlen`. Returns the entry id. Raises ValueError for a field
        named `kind` or `at`."""
        entry: dict[Any, Any] = {"kind": kind, "at": self._clock()}
        for key, value in (fields or {}).items():
            if key in entry:
                raise ValueError(f"event field {key!r} is reserved")
            entry[key] = value
        with redis_errors():
            entry_id = await self._redis.xadd(
                self.keys.events(name), entry, maxlen=maxlen, approximate=True
            )
        return text(entry_id)

    async def events(self, name: str, count: int = 100) -> list[Event]:
        """The latest `count` events of a service, oldest first."""
        with redis_errors():
            entries = await self._redis.xrevrange(self.keys.events(name), count=count)
        out = []
        for entry_id, raw in reversed(entries or []):
            data = {text(key): text(value) for key, value in (raw or {}).items()}
            out.append(
                Event(
                    id=text(entry_id or b""),
                    kind=data.pop("kind", ""),
                    at=float(data.pop("at", 0.0)),
                    fields=data,
                )
            )
        return out

    # -- the leader lease (controlplane/lease.py) ---------------------------------------------

    def lease(self, holder: str, ttl: float) -> Lease:
        """The controller leader lease as `holder` takes it for `ttl` seconds."""
        return Lease(self._redis, self.keys.leader, holder, ttl)

    async def lease_holder(self) -> str | None:
        """Who holds the leader lease now, or None."""
        with redis_errors():
            raw = await self._redis.get(self.keys.leader)
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    # -- pub/sub (pubsub.py) -----------------------------------------------------------------

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
        stream = newer_snapshots(self._redis, self.keys, name, resync_interval=resync_interval,
                                 subscribe_timeout=subscribe_timeout)  # fmt: skip
        try:
            with redis_errors():
                async for snapshot in stream:
                    yield snapshot
        except NoSubscribeConfirmation as exc:
            raise StoreUnavailable(f"redis unavailable: {exc}") from exc
        finally:
            await stream.aclose()

    async def subscribe_control(self) -> ControlSubscription:
        """Subscribe to the control channel (nudges); the caller closes the subscription."""
        return await pubsub.subscribe_control(self._redis, self.keys, self.rejects)

    async def nudge(self, name: str, reason: str = "changed") -> int:
        """Ask the controller to reconcile `name` now. Returns how many listeners got it."""
        return await pubsub.nudge(self._redis, self.keys, name, reason)
