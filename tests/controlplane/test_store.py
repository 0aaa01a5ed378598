"""controlplane.store and controlplane.records against a real redis-server."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from controlplane.records import (
    ReplicaRecord,
    ServiceRecord,
    ServiceState,
    compute_active_versions,
    compute_snapshot,
)
from controlplane.states import ReplicaStatus, ServiceStatus, UpdateMode
from controlplane.store import (
    CommitConflict,
    Mutation,
    RecordInvalid,
    ServiceExists,
    ServiceNotFound,
    Store,
    StoreUnavailable,
    decode_service_record,
    encode_service_record,
)
from controlplane.store.codec import same_ready_set
from proxy.wire.keys import Keys
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot, encode_snapshot
from proxy.wire.telemetry import decode_nudge
from tests.support.builders import registered, replica
from tests.support.poll import until
from tests.support.ports import free_port

READY = ReplicaStatus.READY
replace = msgspec.structs.replace


def routes_alike(a: ReadySnapshot, b: ReadySnapshot) -> bool:
    """True when the commit would not publish `b` over a stored `a` (the store's own test)."""
    return same_ready_set(encode_snapshot(a), encode_snapshot(b), b) is not None


def consistent(state: ServiceState) -> bool:
    """The snapshot is what the records beside it say (and the record's active versions)."""
    snap = state.snapshot
    if snap is None or snap.generation != state.generation:
        return False
    expected = compute_snapshot(state.record, state.replicas.values(), 0, 0.0)
    return routes_alike(snap, expected) and state.record.active_versions == tuple(
        snap.active_versions
    )


# -- keys and pure functions ------------------------------------------------------------------


def test_keys_name_every_key_under_the_prefix() -> None:
    k = Keys()
    assert k.services == "sluice:services"
    assert k.control == "sluice:control"
    assert k.leader == "sluice:leader"
    assert k.service("a") == "sluice:svc:a"
    assert k.spec("a", 3) == "sluice:svc:a:spec:3"
    assert k.replicas("a") == "sluice:svc:a:replicas"
    assert k.snapshot("a") == "sluice:svc:a:snapshot"
    assert k.gen("a") == "sluice:svc:a:gen"
    assert k.ready("a") == "sluice:svc:a:ready"
    assert k.rps("a") == "sluice:svc:a:rps"
    assert k.inflight("a") == "sluice:svc:a:inflight"
    assert k.events("a") == "sluice:svc:a:events"
    assert Keys("x").snapshot("a") == "x:svc:a:snapshot"


@pytest.mark.parametrize(
    ("mode", "min_replicas", "table", "expected"),
    [
        # rolling: every version with a READY replica
        ("rolling", {}, [(1, READY), (2, READY)], (1, 2)),
        ("rolling", {}, [(1, READY), (2, ReplicaStatus.STARTING)], (1,)),
        ("rolling", {}, [(1, ReplicaStatus.NOT_READY)], ()),
        ("rolling", {}, [], ()),
        # blue_green: newest version meeting its min_replicas ...
        ("blue_green", {2: 2}, [(1, READY), (2, READY), (2, READY)], (2,)),
        # ... else the oldest version with a READY replica
        ("blue_green", {2: 2}, [(1, READY), (1, READY), (2, READY)], (1,)),
        ("blue_green", {1: 3, 2: 3}, [(1, READY), (2, READY)], (1,)),
        ("blue_green", {}, [(1, READY), (2, READY)], (2,)),
        ("blue_green", {3: 2}, [(1, READY), (2, READY), (3, READY)], (2,)),
        ("blue_green", {}, [(1, ReplicaStatus.PREEMPTED)], ()),
    ],
)
def test_active_versions(
    mode: str,
    min_replicas: dict[int, int],
    table: list[tuple[int, ReplicaStatus]],
    expected: tuple[int, ...],
) -> None:
    record = ServiceRecord(name="s", update_mode=UpdateMode(mode), min_replicas=min_replicas)
    replicas = [replica(i, version=v, status=s) for i, (v, s) in enumerate(table, 1)]
    assert compute_active_versions(record, replicas) == expected


def test_compute_snapshot_keeps_ready_replicas_of_active_versions_by_id() -> None:
    record = ServiceRecord(
        name="s",
        status=ServiceStatus.READY,
        policy="round_robin",
        update_mode=UpdateMode.BLUE_GREEN,
        min_replicas={2: 2},
    )
    table = [
        replica(5, version=1, accelerator="A100:1", target_qps=3.0, spot=True),
        replica(3, version=1),
        replica(4, version=2),  # version 2 has 1 of 2: not active yet
        replica(2, version=1, status=ReplicaStatus.SHUTTING_DOWN),
        ReplicaRecord(id=1, status=READY),  # READY without a URL: not routable
    ]
    snap = compute_snapshot(record, table, 7, 123.0)
    assert (snap.service, snap.generation, snap.published_at) == ("s", 7, 123.0)
    assert (snap.status, snap.policy, snap.active_versions) == ("READY", "round_robin", [1])
    assert [r.id for r in snap.replicas] == [3, 5]
    assert snap.replicas[1].accelerator == "A100:1"
    assert snap.replicas[1].target_qps == 3.0
    assert snap.replicas[1].spot is True


def test_compute_snapshot_gives_a_url_once() -> None:
    record = ServiceRecord(name="s")
    url = "http://127.0.0.1:9"
    table = [
        ReplicaRecord(id=1, status=READY, url=url, version=1),
        ReplicaRecord(id=2, status=READY, url=url, version=2),
        ReplicaRecord(id=3, status=READY, url=url, version=2),
    ]
    snap = compute_snapshot(record, table, 1, 0.0)
    assert [(r.id, r.version) for r in snap.replicas] == [(2, 2)]


def test_replica_urls_are_checked_when_decoded() -> None:
    bad = b'{"id": 1, "url": "http://"}'
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(bad, type=ReplicaRecord)
    for url in ("http://h", "https://h:8443", "http://[::1]:80/v1", "http://10.0.0.1:8000"):
        msgspec.json.decode(msgspec.json.encode({"id": 1, "url": url}), type=ReplicaRecord)


def test_service_record_hash_round_trip() -> None:
    record = ServiceRecord(
        name="s",
        status=ServiceStatus.NO_REPLICA,
        version=3,
        active_versions=(2, 3),
        update_mode=UpdateMode.BLUE_GREEN,
        created_at=1.5,
        min_replicas={3: 2},
    )
    fields = encode_service_record(record)
    assert fields["status"] == b"NO_REPLICA"  # strings raw: readable from redis-cli
    assert fields["active_versions"] == b"[2,3]"
    assert "endpoint" not in fields  # None fields are left out
    raw = {k.encode(): v for k, v in fields.items()}
    raw[b"future_field"] = b"from a newer controller"
    assert decode_service_record(raw) == record
    with pytest.raises(RecordInvalid):
        decode_service_record({b"name": b"s", b"version": b"not json"})


def test_nudges_decode_from_json_or_a_bare_name() -> None:
    assert decode_nudge(b'{"service": "a", "reason": "demand"}').reason == "demand"
    assert decode_nudge(b"a\n").service == "a"


# -- registration and commits -----------------------------------------------------------------


async def test_register_writes_record_spec_membership_and_a_first_snapshot(
    store: Store, redis_client: aioredis.Redis
) -> None:
    record = await registered(store, endpoint="http://127.0.0.1:8080")
    assert await store.services() == ["svc"]
    stored = await store.service("svc")
    assert stored is not None and stored.created_at > 0
    assert replace(stored, created_at=0.0) == record
    assert await store.spec("svc", 1) == b'{"replicas": 2}'
    assert await store.spec("svc", 2) is None
    snap = await store.snapshot("svc")
    assert snap is not None and snap.generation == 1 and snap.replicas == ()
    assert await store.generation("svc") == 1
    assert await redis_client.hget(store.keys.service("svc"), "status") == b"READY"
    with pytest.raises(ServiceExists):
        await registered(store)


async def test_commit_to_an_unknown_service_writes_nothing(
    store: Store, redis_client: aioredis.Redis
) -> None:
    with pytest.raises(ServiceNotFound):
        await store.commit("nope", replica_updates=[replica(1)])
    assert await redis_client.exists(store.keys.replicas("nope"), store.keys.gen("nope")) == 0


async def test_commit_refuses_contradictory_arguments(store: Store) -> None:
    await registered(store)
    with pytest.raises(ValueError, match="repeat"):
        await store.commit("svc", replica_updates=[replica(1), replica(1)])
    with pytest.raises(ValueError, match="both"):
        await store.commit("svc", replica_updates=[replica(1)], replica_deletes=[1])
    with pytest.raises(ValueError, match="url"):
        await store.commit("svc", replica_updates=[ReplicaRecord(id=1, url="ftp://x")])
    with pytest.raises(ValueError, match="not 'svc'"):
        await store.commit("svc", service_record=ServiceRecord(name="other"))
    assert await store.replicas("svc") == {}
    assert await store.generation("svc") == 1


async def test_commit_writes_records_and_publishes_the_snapshot(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await registered(store)
    async with redis_client.pubsub() as pubsub:
        await pubsub.subscribe(store.keys.ready("svc"))
        assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"
        snap = await store.commit("svc", replica_updates=[replica(1), replica(2)])
        message = await pubsub.get_message(timeout=5)
    assert message is not None and message["type"] == "message"
    assert decode_snapshot(message["data"]) == snap
    assert await store.snapshot("svc") == snap
    assert snap.generation == 2 and [r.id for r in snap.replicas] == [1, 2]
    assert await store.replicas("svc") == {1: replica(1), 2: replica(2)}
    assert await store.replica("svc", 2) == replica(2)
    assert (await store.service("svc")).active_versions == (1,)  # type: ignore[union-attr]

    snap = await store.commit(
        "svc", replica_updates=[replica(2, status=ReplicaStatus.NOT_READY)], replica_deletes=[1]
    )
    assert snap.generation == 3 and snap.replicas == () and snap.active_versions == []
    assert set(await store.replicas("svc")) == {2}
    assert (await store.service("svc")).active_versions == ()  # type: ignore[union-attr]


async def test_a_commit_that_does_not_change_routing_keeps_the_generation(store: Store) -> None:
    await registered(store)
    first = await store.commit("svc", replica_updates=[replica(1)])
    again = await store.commit("svc", replica_updates=[replica(1, failures=2)])
    assert again == first  # records written, nothing new to publish
    assert (await store.replica("svc", 1)).failures == 2  # type: ignore[union-attr]
    assert await store.generation("svc") == first.generation
    forced = await store.commit("svc", force=True)
    assert forced.generation == first.generation + 1
    assert routes_alike(forced, first)


async def test_blue_green_switches_in_the_commit_that_reaches_min_replicas(store: Store) -> None:
    record = await registered(store, update_mode=UpdateMode.BLUE_GREEN)
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    record = replace(record, version=2, min_replicas={2: 2})
    snap = await store.commit("svc", service_record=record, replica_updates=[replica(3, version=2)])
    assert snap.active_versions == [1] and [r.id for r in snap.replicas] == [1, 2]
    snap = await store.commit("svc", replica_updates=[replica(4, version=2)])
    assert snap.active_versions == [2] and [r.id for r in snap.replicas] == [3, 4]
    stored = await store.service("svc")
    assert stored is not None and stored.version == 2 and stored.active_versions == (2,)


async def test_a_corrupt_record_blocks_commits_until_replaced(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await registered(store)
    await redis_client.hset(store.keys.replicas("svc"), "9", b'{"id": 9, "url": 42}')
    with pytest.raises(RecordInvalid, match="replica '9'"):
        await store.commit("svc", replica_updates=[replica(1)])
    snap = await store.commit("svc", replica_updates=[replica(1)], replica_deletes=[9])
    assert [r.id for r in snap.replicas] == [1]


async def test_readers_never_see_records_and_snapshot_disagree(
    store: Store, redis_url: str, redis_prefix: str
) -> None:
    await registered(store)
    commits = 2000
    done = False
    reads = 0

    async def reader() -> None:
        nonlocal reads
        async with Store.from_url(redis_url, prefix=redis_prefix) as own:
            while not done:
                state = await own.read_state("svc")
                assert state is not None and consistent(state), state
                reads += 1

    async def committer() -> None:
        nonlocal done
        try:
            for i in range(commits):
                # 2 -> 3 -> 2 replicas, and versions appear and retire, so every commit
                # changes both the records and the snapshot.
                if i % 2 == 0:
                    await store.commit("svc", replica_updates=[replica(3, version=1 + i % 3)])
                else:
                    await store.commit(
                        "svc", replica_updates=[replica(1), replica(2)], replica_deletes=[3]
                    )
        finally:
            done = True

    async with asyncio.TaskGroup() as group:
        group.create_task(committer())
        group.create_task(reader())
    assert reads > 100
    assert await store.generation("svc") == 1 + commits


async def test_generations_strictly_increase_under_concurrent_committers(
    store: Store, redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    await registered(store)
    committers, each = 8, 25
    published: list[int] = []

    async with redis_client.pubsub() as pubsub:
        await pubsub.subscribe(store.keys.ready("svc"))
        assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"

        async def commit_many(n: int) -> list[int]:
            gens = []
            async with Store.from_url(redis_url, prefix=redis_prefix) as own:
                for i in range(each):
                    status = READY if i % 2 == 0 else ReplicaStatus.NOT_READY
                    snap = await own.commit("svc", replica_updates=[replica(n, status=status)])
                    gens.append(snap.generation)
            return gens

        async with asyncio.TaskGroup() as group:  # a failure cancels the other committers
            tasks = [group.create_task(commit_many(n)) for n in range(1, committers + 1)]
        results = [task.result() for task in tasks]
        while len(published) < committers * each:
            message = await pubsub.get_message(timeout=5)
            assert message is not None
            published.append(decode_snapshot(message["data"]).generation)

    for gens in results:
        assert gens == sorted(set(gens))  # each committer saw its own commits in order
    everything = sorted(g for gens in results for g in gens)
    assert everything == list(range(2, 2 + committers * each))  # no generation twice or lost
    assert published == everything  # published in generation order
    state = await store.read_state("svc")
    assert state is not None and consistent(state)
    last = READY if (each - 1) % 2 == 0 else ReplicaStatus.NOT_READY
    assert {r.status for r in state.replicas.values()} == {last}


async def test_commit_gives_up_after_max_attempts(
    redis_client: aioredis.Redis, redis_prefix: str, redis_url: str
) -> None:
    """Another writer gets in after every run of the plan read the table: after
    `max_commit_attempts` runs the commit gives up, having written nothing."""
    store = Store(redis_client, prefix=redis_prefix, max_commit_attempts=2)
    await registered(store)
    other_writer = redis.Redis.from_url(redis_url)
    runs = 0

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, None]:
        nonlocal runs
        runs += 1
        other_writer.hset(
            store.keys.replicas("svc"), "7", msgspec.json.encode(replica(7, failures=runs))
        )
        return Mutation(replica_updates=(replica(1),)), None

    try:
        with pytest.raises(CommitConflict):
            await store.commit_with("svc", plan)
    finally:
        other_writer.close()
    assert runs == 2
    assert set(await store.replicas("svc")) == {7}


async def test_unregister_publishes_an_empty_snapshot_and_keeps_the_generation(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await registered(store)
    await store.commit("svc", replica_updates=[replica(1)])
    await store.append_event("svc", "launch")
    final = await store.unregister_service("svc")
    assert final.status == "SHUTTING_DOWN" and final.replicas == () and final.generation == 3
    assert await store.services() == []
    assert await store.service("svc") is None
    assert await store.read_state("svc") is None
    left = {k async for k in redis_client.scan_iter(match=f"{store.keys.prefix}:*")}
    markers = {k for k in left if k.startswith(store.keys.op("").encode())}
    assert left - markers == {store.keys.gen("svc").encode(), store.keys.snapshot("svc").encode()}
    for marker in markers:  # applied-transaction markers expire by themselves
        assert 0 < await redis_client.pttl(marker) <= 60_000
    with pytest.raises(ServiceNotFound):
        await store.unregister_service("svc")
    again = await store.register_service(ServiceRecord(name="svc"), b"{}")
    assert again.generation == 4  # proxies holding generation 3 accept it


# -- events, rates, lease, nudges -------------------------------------------------------------


async def test_events_are_appended_and_trimmed(store: Store) -> None:
    first = await store.append_event("svc", "update", {"version": 2, "mode": "rolling"})
    await store.append_event("svc", "launch", {"replica": 3})
    events = await store.events("svc")
    assert [e.kind for e in events] == ["update", "launch"]
    assert events[0].id == first and events[0].fields == {"version": "2", "mode": "rolling"}
    assert events[0].at > 0
    with pytest.raises(ValueError, match="reserved"):
        await store.append_event("svc", "x", {"kind": "y"})
    for i in range(300):
        await store.append_event("svc", "probe", {"i": i}, maxlen=10)
    assert len(await store.events("svc", count=1000)) < 300  # approximate trim (~)


async def test_rps_read_and_trim(store: Store, redis_client: aioredis.Redis) -> None:
    key = store.keys.rps("svc")
    await redis_client.hincrby(key, "100", 5)
    await redis_client.hincrby(key, "101", 7)
    await redis_client.hincrby(key, "100", 1)
    assert await store.telemetry.read_rps("svc") == {100: 6, 101: 7}
    assert await store.telemetry.trim_rps("svc", before=101) == 1
    assert await store.telemetry.read_rps("svc") == {101: 7}
    assert await store.telemetry.trim_rps("svc", before=50) == 0


async def test_leader_lease(store: Store) -> None:
    assert await store.lease_holder() is None
    assert await store.lease("a", 10).acquire()
    assert not await store.lease("b", 10).acquire()
    assert await store.lease("a", 10).acquire()  # the holder re-acquires (extends)
    assert await store.lease("a", 10).extend()
    assert not await store.lease("b", 10).extend()
    assert not await store.lease("b", 30).release()
    assert await store.lease_holder() == "a"
    assert await store.lease("a", 30).release()
    assert await store.lease("b", 0.05).acquire()
    async def expired() -> bool:  # after 50 ms
        return await store.lease_holder() is None

    await until(expired, timeout=5, what="the lease to expire")
    assert not await store.lease("b", 10).extend()
    with pytest.raises(ValueError):
        await store.lease("a", 0).acquire()


async def test_nudge_reaches_the_control_channel(
    store: Store, redis_client: aioredis.Redis
) -> None:
    async with redis_client.pubsub() as pubsub:
        await pubsub.subscribe(store.keys.control)
        assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"
        assert await store.nudge("svc", "demand") == 1
        message = await pubsub.get_message(timeout=5)
    assert message is not None
    nudge = decode_nudge(message["data"])
    assert (nudge.service, nudge.reason) == ("svc", "demand")


# -- failures ---------------------------------------------------------------------------------


async def test_unreachable_redis_raises_store_unavailable() -> None:
    async with Store.from_url(f"redis://127.0.0.1:{free_port()}/0") as store:
        with pytest.raises(StoreUnavailable):
            await store.ping()
        with pytest.raises(StoreUnavailable):
            await store.commit("svc", replica_updates=[replica(1)])


async def test_store_over_a_password_url(redis_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_factory(password="s3cr:t/pw")
    async with Store.from_url(server.url) as store:
        await registered(store)
        snap = await store.commit("svc", replica_updates=[replica(1)])
        assert await store.snapshot("svc") == snap
    async with Store.from_url(server.url.replace("s3cr", "wrong")) as store:
        with pytest.raises(StoreUnavailable):  # redis-py's AuthenticationError
            await store.ping()


async def test_reads_of_an_unknown_service_are_empty(store: Store) -> None:
    assert await store.service("none") is None
    assert await store.replicas("none") == {}
    assert await store.snapshot("none") is None
    assert await store.generation("none") == 0
    assert await store.events("none") == []
    assert await store.telemetry.read_rps("none") == {}


async def test_prefix_options_reach_the_snapshot_and_a_change_publishes(store: Store) -> None:
    from proxy.wire.snapshot import PrefixOptions

    options = PrefixOptions(epsilon=0.75)
    record = await registered(store, policy="prefix", prefix_options=options)
    assert decode_service_record(encode_service_record(record)) == record
    first = await store.commit("svc", replica_updates=[replica(1)])
    assert first.policy == "prefix" and first.prefix_options == options
    # Only the options change: routing changes, so a new generation is published.
    current = await store.service("svc")
    assert current is not None
    changed = await store.commit(
        "svc", service_record=replace(current, prefix_options=PrefixOptions(epsilon=1.5)))
    assert changed.generation == first.generation + 1
    assert changed.prefix_options == PrefixOptions(epsilon=1.5)
    assert not routes_alike(changed, first)


async def test_commit_with_returns_the_result_of_the_plan_run_it_wrote(
    store: Store, redis_url: str
) -> None:
    """A write between the plan's read and its EXEC makes the plan run again; the result
    returned is the second run's, which saw the interfering write."""
    await registered(store)
    runs: list[list[int]] = []
    other_writer = redis.Redis.from_url(redis_url)

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, int]:
        runs.append(sorted(replicas))
        if len(runs) == 1:  # another writer gets in after this run read the table
            other_writer.hset(store.keys.replicas("svc"), "7", msgspec.json.encode(replica(7)))
        new_id = max(replicas, default=0) + 1
        return Mutation(replica_updates=(replica(new_id),)), new_id

    try:
        committed = await store.commit_with("svc", plan)
    finally:
        other_writer.close()
    assert runs == [[], [7]]
    assert committed.result == 8
    assert sorted(r.id for r in committed.snapshot.replicas) == [7, 8]


async def test_resume_streams_reaches_the_snapshot_and_a_change_publishes(store: Store) -> None:
    record = await registered(store, resume_streams=True)
    assert decode_service_record(encode_service_record(record)) == record
    first = await store.commit("svc", replica_updates=[replica(1)])
    assert first.resume_streams is True
    current = await store.service("svc")
    assert current is not None
    changed = await store.commit("svc", service_record=replace(current, resume_streams=False))
    assert changed.generation == first.generation + 1 and changed.resume_streams is False
    assert not routes_alike(changed, first)
