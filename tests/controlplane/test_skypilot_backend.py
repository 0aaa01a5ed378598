"""The SkyPilot backend: names, the task it builds, and the real controller driving it
end to end against a FAKE SkyPilot (tests/support/skypilot_fake.py: local processes stand in
for clusters) with a real redis-server and real replica processes."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from controlplane import ops
from controlplane.backends.external import ExternalBackend
from controlplane.backends.local import LocalBackend
from controlplane.backends.skypilot import SkyPilotBackend, SkyPilotConfig
from controlplane.backends.skypilot_sdk import SdkError
from controlplane.backends.skypilot_task import (
    CLUSTER_NAME_RE,
    cluster_name,
    cluster_prefix,
    parse_cluster,
    replica_url,
    task_config,
)
from controlplane.reconcile import ControllerConfig
from controlplane.records import ReplicaRecord
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.states import ReplicaStatus
from controlplane.store import Mutation, Store
from tests.support.builders import PROBE, RUN, ready_view
from tests.support.fakes import StartController, controller_config, controller_starter
from tests.support.poll import must_finish, until
from tests.support.processes import REPO
from tests.support.skypilot_fake import FakeSkyPilot

FAST = SkyPilotConfig(
    namespace="t",
    launch_timeout=20.0,
    launch_retries=2,
    retry_backoff=0.05,
    down_retries=4,
    down_backoff=0.05,
    down_timeout=10.0,
    refresh_interval=0.3,
    refresh_timeout=5.0,
    nonspot_refresh_gap=60.0,
    submit_timeout=5.0,
)


def make_spec(
    replicas: int = 2, *, env: str = "a", resources: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
) -> ServiceSpec:  # fmt: skip
    service: dict[str, Any] = {"readiness_probe": PROBE, "ports": 8080}
    if policy is not None:
        service["replica_policy"] = policy
    else:
        service["replicas"] = replicas
    return parse_spec(
        {
            "service": service,
            "resources": {"ports": 8080, "cpus": 1, **(resources or {})},
            "workdir": str(REPO),
            "envs": {"VARIANT": env},
            "run": RUN,
        }
    )


# -- names, URLs, the task ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "service", ["echo", "My_Service.v2", "9lives", "a" * 80, "x--y", "ünïcode", "a/b"]
)
def test_cluster_names_follow_skypilots_rule_and_parse_back(service: str) -> None:
    name = cluster_name("sluice", service, 12, 3)
    assert CLUSTER_NAME_RE.fullmatch(name), name
    assert len(name) < 64
    assert parse_cluster(cluster_prefix("sluice", service), name) == (12, 3)


def test_cluster_prefixes_of_different_services_never_claim_each_others_clusters() -> None:
    a, b = cluster_prefix("sluice", "a"), cluster_prefix("sluice", "a-r1-v1")
    assert parse_cluster(a, cluster_name("sluice", "a-r1-v1", 2, 1)) is None
    assert parse_cluster(b, cluster_name("sluice", "a", 1, 1)) is None
    # Names that slug alike stay apart (a hash suffix).
    assert cluster_prefix("sluice", "A.b") != cluster_prefix("sluice", "a-b")


def test_replica_url_keeps_an_ingress_path_and_adds_a_scheme() -> None:
    assert replica_url("1.2.3.4:8080") == "http://1.2.3.4:8080"
    assert (
        replica_url("http://ingress.example/skypilot/ns/svc-8080/")
        == "http://ingress.example/skypilot/ns/svc-8080"
    )
    assert replica_url("https://h:443/p") == "https://h:443/p"


def test_task_is_the_yaml_without_service_with_the_port_and_replica_env() -> None:
    spec = parse_spec(
        {
            "service": {"readiness_probe": "/health", "replicas": 1, "ports": 8000},
            # Sky Serve requires the service port among the opened ones.
            "resources": {"accelerators": "L4:1", "ports": [8000, 9000], "use_spot": True},
            "setup": "pip install vllm",
            "run": "vllm serve",
            "envs": {"A": "1"},
            "secrets": {"HF_TOKEN": "hf_x"},
            "workdir": "examples",
            "file_mounts": {"/data": "s3://bucket"},
        }
    )
    task = task_config(spec, replica_id=7, port=8000, base_dir=Path("/repo"))
    assert "service" not in task
    assert task["resources"] == {
        "accelerators": "L4:1", "ports": ["8000", "9000"], "use_spot": True,
    }  # fmt: skip
    assert task["envs"] == {"A": "1", "PORT": "8000", "SLUICE_REPLICA_ID": "7",
                            "SKYPILOT_SERVE_REPLICA_ID": "7"}  # fmt: skip
    assert task["secrets"] == {"HF_TOKEN": "hf_x"}
    assert task["workdir"] == "/repo/examples"
    assert task["file_mounts"] == {"/data": "s3://bucket"}
    assert task["setup"] == "pip install vllm" and task["run"] == "vllm serve"


def test_on_demand_fallback_overrides_use_spot_everywhere() -> None:
    spec = parse_spec(
        {
            "service": {"replicas": 1, "ports": 8000},
            "resources": {"use_spot": True, "ports": 8000,
                          "any_of": [{"infra": "aws", "use_spot": True}, {"infra": "gcp"}]},
            "run": "x",
        }
    )  # fmt: skip
    task = task_config(spec, replica_id=1, port=8000, on_demand=True)
    assert task["resources"]["use_spot"] is False
    assert task["resources"]["any_of"] == [{"infra": "aws", "use_spot": False}, {"infra": "gcp"}]
    spot = task_config(spec, replica_id=1, port=8000)
    assert spot["resources"]["use_spot"] is True


def test_dynamic_fallback_placer_tries_preempted_locations_last() -> None:
    spec = parse_spec(
        {
            "service": {"replica_policy": {"min_replicas": 1, "spot_placer": "dynamic_fallback"},
                        "ports": 8000},
            "resources": {"use_spot": True, "ports": 8000, "any_of": [
                {"infra": "aws/us-east-1"}, {"infra": "aws/us-west-2"}, {"infra": "gcp"}]},
            "run": "x",
        }
    )  # fmt: skip
    task = task_config(spec, replica_id=1, port=8000, avoid={("aws", "us-east-1", "us-east-1a")})
    assert task["resources"]["any_of"] == [{"infra": "aws/us-west-2"}, {"infra": "gcp"}]
    ordered = msgspec.structs.replace(
        spec,
        resources=msgspec.structs.replace(
            spec.resources, any_of=None, ordered=[{"infra": "aws/us-east-1"}, {"infra": "gcp"}]
        ),
    )
    task = task_config(ordered, replica_id=1, port=8000, avoid={("aws", "us-east-1", "x")})
    assert task["resources"]["ordered"] == [{"infra": "gcp"}, {"infra": "aws/us-east-1"}]
    # Every location preempted: nothing is preferred, the task is as written.
    everywhere = {("aws", "us-east-1"), ("aws", "us-west-2"), ("gcp",)}
    assert "any_of" in task_config(spec, replica_id=1, port=8000, avoid=everywhere)["resources"]


# -- the backend alone, on the fake --------------------------------------------------------------


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[FakeSkyPilot]:
    sky = FakeSkyPilot(log_dir=tmp_path)
    yield sky
    await must_finish(sky.shutdown(), "shutting the fake SkyPilot down")


@pytest.fixture
async def backend(fake: FakeSkyPilot) -> AsyncIterator[SkyPilotBackend]:
    b = SkyPilotBackend(FAST, sdk=fake)
    await b.start()
    yield b
    await b.aclose()


async def test_launch_records_cluster_request_and_resources(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    launched = await backend.launch("svc", 1, 1, make_spec(resources={"use_spot": True}), spot=True)
    handle = launched.handle
    assert handle["cluster"] == "t.svc-r1-v1" and fake.up_names() == ["t.svc-r1-v1"]
    assert isinstance(handle["request_id"], str) and handle["request_id"].startswith("fake-req-")
    assert (handle["cloud"], handle["region"], handle["zone"]) == (
        "fake", "fake-region-1", "fake-zone-a",
    )  # fmt: skip
    assert handle["spot"] is True and handle["price"] == 0.25
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", launched.url)
    assert backend.exited(handle) is None
    await backend.terminate(handle)
    assert fake.names() == []
    await backend.terminate(handle)  # idempotent: the cluster is already gone


async def test_ingress_endpoint_path_is_kept_in_the_replica_url(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    fake.endpoint_path = "/skypilot/default/t.svc-r1-v1-8080"
    launched = await backend.launch("svc", 1, 1, make_spec())
    assert launched.url.endswith(":" + launched.url.split(":")[2].split("/")[0] +
                                 "/skypilot/default/t.svc-r1-v1-8080")  # fmt: skip


async def test_retryable_launch_failure_is_retried_then_succeeds(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    fake.fail_launches = [SdkError("ResourcesUnavailableError: no capacity", retryable=True)]
    launched = await backend.launch("svc", 1, 1, make_spec())
    assert [n for n, _ in fake.launches] == ["t.svc-r1-v1", "t.svc-r1-v1"]
    assert launched.handle["cluster"] == "t.svc-r1-v1"


async def test_hanging_launch_is_bounded_cancelled_and_torn_down(
    fake: FakeSkyPilot,
) -> None:
    backend = SkyPilotBackend(dataclasses.replace(FAST, launch_timeout=0.5), sdk=fake)
    await backend.start()
    try:
        fake.hang_launches = 1
        with pytest.raises(Exception, match=r"did not bring cluster t.svc-r1-v1 up within 0.5s"):
            await backend.launch("svc", 1, 1, make_spec())
        assert ("cancel", "fake-req-1") in fake.events
        assert fake.names() == []
    finally:
        await backend.aclose()


async def test_down_errors_are_retried(backend: SkyPilotBackend, fake: FakeSkyPilot) -> None:
    launched = await backend.launch("svc", 1, 1, make_spec())
    fake.fail_downs = 2
    await backend.terminate(launched.handle)
    assert fake.names() == [] and fake.fail_downs == 0


async def test_down_that_keeps_failing_raises_after_the_retries(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    launched = await backend.launch("svc", 1, 1, make_spec())
    fake.fail_downs = 100
    with pytest.raises(Exception, match=r"sky\.down of cluster t.svc-r1-v1 failed 4 times"):
        await backend.terminate(launched.handle)
    assert fake.fail_downs == 96


async def test_preempted_spot_cluster_is_seen_after_a_suspected_refresh_and_avoided(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    spec = make_spec(
        resources={"use_spot": True, "any_of": [{"infra": "aws/us-east-1/us-east-1a"},
                                                {"infra": "gcp/us-central1/us-central1-a"}]},
        policy={"min_replicas": 1, "spot_placer": "dynamic_fallback"},
    )  # fmt: skip
    launched = await backend.launch("svc", 1, 1, spec, spot=True)
    assert launched.handle["cloud"] == "aws"
    await fake.preempt("t.svc-r1-v1")
    # status without a refresh still says UP (SkyPilot's cache): not yet preempted
    await asyncio.sleep(0)
    assert backend.preemption(launched.handle) is None or fake.events[-1][0] == "preempt"
    backend.suspect(launched.handle)
    await until(lambda: backend.preemption(launched.handle) is not None, timeout=5,
                     what="the refreshed status to show the preemption")  # fmt: skip
    assert backend.preempted_locations("svc") == {("aws", "us-east-1", "us-east-1a")}
    again = await backend.launch("svc", 2, 1, spec, spot=True)
    task = fake.tasks["t.svc-r2-v1"]["resources"]
    assert task["any_of"] == [{"infra": "gcp/us-central1/us-central1-a"}]
    assert again.handle["cloud"] == "gcp"


async def test_non_spot_suspicion_refreshes_at_most_once_a_minute(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    launched = await backend.launch("svc", 1, 1, make_spec())
    backend.suspect(launched.handle)
    await until(lambda: fake.forced == [["t.svc-r1-v1"]], timeout=5, what="forced refresh")
    backend.suspect(launched.handle)  # within the minute: no second forced refresh
    listings = fake.listings
    await until(lambda: fake.listings >= listings + 2, timeout=5, what="two more refreshes")
    assert fake.forced == [["t.svc-r1-v1"]]


async def test_tail_logs_streams_the_cluster_log(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    from controlplane.backends.skypilot import stream_logs

    run = "echo hello from $SLUICE_REPLICA_ID; exec sleep 60"
    spec = msgspec.structs.replace(make_spec(), run=run)
    launched = await backend.launch("svc", 1, 1, spec)
    await until(lambda: fake.clusters["t.svc-r1-v1"].log.stat().st_size > 0, timeout=10,
                     what="the replica to log")  # fmt: skip
    out = io.StringIO()
    code = await stream_logs(fake, launched.handle, follow=False, out=out)
    assert code == 0 and out.getvalue() == "hello from 1\n"


# -- end to end: the real controller, a real redis-server, the fake SkyPilot --------------------


@pytest.fixture
def config(redis_url: str, redis_prefix: str, tmp_path: Path) -> ControllerConfig:
    return controller_config(redis_url, redis_prefix, tmp_path, drain_seconds=0.5,
                             reconcile_interval=0.5, terminate_on_exit=False,
                             backend="skypilot")  # fmt: skip


@pytest.fixture
async def start_controller(
    store: Store, config: ControllerConfig, fake: FakeSkyPilot
) -> AsyncIterator[StartController]:
    def backends(cfg: ControllerConfig) -> dict[str, Any]:
        return {"local": LocalBackend(cfg.state_dir), "external": ExternalBackend(),
                "skypilot": SkyPilotBackend(FAST, sdk=fake)}  # fmt: skip

    async with controller_starter(store, config, backends) as start:
        yield start


async def ready(store: Store, name: str, n: int, version: int | None = None) -> ops.ServiceView:
    return await ready_view(store, name, n, version, timeout=60)  # a cloud launch is slower


async def test_replicas_are_clusters_and_a_count_only_update_relaunches_nothing(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    view = await ready(store, "svc", 2)
    assert {r.backend for r in view.replicas} == {"skypilot"}
    assert fake.up_names() == ["t.svc-r1-v1", "t.svc-r2-v1"]
    replicas = (await store.read_state("svc")).replicas  # type: ignore[union-attr]
    assert replicas[1].handle["cluster"] == "t.svc-r1-v1"

    await ops.update(store, "svc", make_spec(3))
    view = await ready(store, "svc", 3, version=2)
    assert [r.id for r in view.replicas] == [1, 2, 3]
    assert [n for n, _ in fake.launches] == ["t.svc-r1-v1", "t.svc-r2-v1", "t.svc-r3-v2"]
    assert not any(kind == "down" for kind, _ in fake.events)


async def test_rolling_update_replaces_clusters_one_by_one(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    await ready(store, "svc", 2)
    await ops.update(store, "svc", make_spec(2, env="b"))
    await ready(store, "svc", 2, version=2)
    await until(lambda: len(fake.names()) == 2, timeout=30, what="old clusters down")
    assert fake.up_names() == ["t.svc-r3-v2", "t.svc-r4-v2"]
    # One old cluster retired per new one UP: never a v1 down before a v2 cluster serves.
    ups = downs = 0
    for kind, name in fake.events:
        if kind == "up" and name.endswith("-v2"):
            ups += 1
        if kind == "down" and name.endswith("-v1"):
            downs += 1
            assert downs <= ups, fake.events


async def test_preempted_spot_replica_is_replaced_with_on_demand_fallback(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    await start_controller()
    spec = make_spec(
        resources={"use_spot": True},
        policy={"min_replicas": 1, "dynamic_ondemand_fallback": True},
    )
    await ops.up(store, "svc", spec)
    # The on-demand fallback serves until the spot replica is READY, then leaves.
    view = await ready(store, "svc", 1)
    spot = view.replicas[0]
    assert spot.spot
    state = await store.read_state("svc")
    assert state is not None
    cluster = state.replicas[spot.id].handle["cluster"]
    assert isinstance(cluster, str)
    on_demand_before = [n for n, t in fake.launches if t["resources"]["use_spot"] is False]
    assert on_demand_before, "dynamic_ondemand_fallback launches an on-demand replica at first"

    await fake.preempt(cluster)
    await ops.wait_for(store, "svc", lambda v: any(r.status == "PREEMPTED" for r in v.replicas)
                       or spot.id not in {r.id for r in v.replicas}, timeout=30)  # fmt: skip
    kinds = [e.kind for e in await store.events("svc", count=1000)]
    assert "preempt" in kinds
    # Replaced: a new spot replica, and an on-demand one launched while it was not READY.
    view = await ready(store, "svc", 1)
    assert view.replicas[0].id != spot.id and view.replicas[0].spot
    on_demand_after = [n for n, t in fake.launches if t["resources"]["use_spot"] is False]
    assert len(on_demand_after) > len(on_demand_before)
    await until(lambda: cluster not in fake.names(), timeout=10, what="preempted one down")


async def test_launch_failure_shows_failed_provision_with_skypilots_reason(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    reason = "Failed to acquire resources in all zones in us-east-1 for {AWS(g6.xlarge, L4:1)}"
    fake.fail_launches = [SdkError(reason)]
    await start_controller()
    await ops.up(store, "svc", make_spec(1))
    view = await ops.wait_for(
        store, "svc", lambda v: any(r.status == "FAILED_PROVISION" for r in v.replicas)
        or bool(v.last_failure), timeout=30,
    )  # fmt: skip
    await ops.wait_for(store, "svc", lambda v: bool(v.last_failure), timeout=30)
    view = (await ops.status(store, "svc"))[0]
    assert view.last_failure is not None and reason in view.last_failure
    assert "FAILED_PROVISION" in [
        e.fields.get("status") for e in await store.events("svc", count=1000)
    ]


async def test_controller_restart_adopts_clusters_and_tears_down_unrecorded_ones(
    store: Store, start_controller: StartController, fake: FakeSkyPilot, config: ControllerConfig
) -> None:
    first = await start_controller(terminate_on_exit=False)
    spec = make_spec(3)
    await ops.up(store, "svc", spec)
    view = await ready(store, "svc", 3)
    urls = {r.id: r.url for r in view.replicas}
    await start_controller.stop(first)  # type: ignore[attr-defined]  # replicas keep running

    # What a controller that died mid-launch leaves: a record still PROVISIONING whose
    # cluster came up (replica 3), and clusters no record owns.
    await fake.add_running("t.svc-r9-v1", task_config(spec, replica_id=9, port=8080))
    await fake.add_running("t.gone-r1-v1", task_config(spec, replica_id=1, port=8080))
    await fake.add_running("someone-elses-cluster", task_config(spec, replica_id=1, port=8080))

    def plan(current: Any, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, None]:
        unrecorded = ReplicaRecord(
            id=3, status=ReplicaStatus.PROVISIONING, version=1, backend="skypilot"
        )
        return Mutation(replica_updates=(unrecorded,)), None

    await store.commit_with("svc", plan)
    launches_before = len(fake.launches)
    await start_controller(terminate_on_exit=True)
    view = await ready(store, "svc", 3)
    assert {r.id: r.url for r in view.replicas} == urls  # the same clusters, adopted
    await until(lambda: "t.svc-r9-v1" not in fake.names() and "t.gone-r1-v1"
                     not in fake.names(), timeout=20, what="unrecorded clusters down")  # fmt: skip
    assert "someone-elses-cluster" in fake.names()  # not named like ours: never touched
    assert len(fake.launches) == launches_before  # adopted, nothing relaunched
    assert fake.up_names() == ["someone-elses-cluster", "t.svc-r1-v1", "t.svc-r2-v1",
                               "t.svc-r3-v1"]  # fmt: skip


async def test_down_tears_every_cluster_down(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    await ready(store, "svc", 2)
    fake.fail_downs = 1  # one sky.down error on the way: retried
    await ops.down(store, "svc")

    async def gone() -> bool:
        return "svc" not in await store.services()

    await until(gone, timeout=30, what="the service to be unregistered")
    assert fake.names() == []


async def test_status_shows_infra_and_resources_columns(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    from controlplane.display import status_text

    await start_controller()
    await ops.up(store, "svc", make_spec(1, resources={"use_spot": True}))
    view = await ready(store, "svc", 1)
    text = status_text([view], now=0.0)
    assert "INFRA" in text and "RESOURCES" in text
    assert "fake (fake-region-1, fake-zone-a)" in text
    assert "1x[Spot](fake-1x) $0.25/h" in text


async def test_replica_preempt_simulation_tears_the_cluster_down_and_replaces_it(
    store: Store, start_controller: StartController, fake: FakeSkyPilot
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(1, resources={"use_spot": True}))
    await ready(store, "svc", 1)
    await ops.preempt_replica(store, "svc", 1)
    view = await ready(store, "svc", 1)
    assert view.replicas[0].id == 2
    await until(lambda: fake.names() == ["t.svc-r2-v1"], timeout=20, what="r1 torn down")
    assert ("down", "t.svc-r1-v1") in fake.events


async def test_cluster_states_as_liveness_and_preemption(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    on_demand = await backend.launch("svc", 1, 1, make_spec())
    spot = await backend.launch("svc", 2, 1, make_spec(resources={"use_spot": True}), spot=True)
    listings = fake.listings
    fake.clusters["t.svc-r1-v1"].status = "INIT"  # SkyPilot's "unhealthy"
    fake.clusters["t.svc-r2-v1"].status = "INIT"
    await until(lambda: fake.listings >= listings + 2, timeout=5, what="a fresh listing")
    assert backend.exited(on_demand.handle) is None  # the probes judge it
    assert backend.preemption(on_demand.handle) is None  # not spot: never preempted
    assert backend.preemption(spot.handle) == "cluster t.svc-r2-v1 is INIT"
    await fake.stop("t.svc-r1-v1")
    await fake.down("t.svc-r2-v1")
    listings = fake.listings
    await until(lambda: fake.listings >= listings + 2, timeout=5, what="a fresh listing")
    assert backend.exited(on_demand.handle) == "cluster t.svc-r1-v1 is STOPPED"
    assert backend.exited(spot.handle) == "cluster t.svc-r2-v1 is gone"


async def test_a_launch_failing_after_provisioning_never_leaves_the_machine(
    backend: SkyPilotBackend, fake: FakeSkyPilot
) -> None:
    fake.fail_after_up = [SdkError("setup failed: pip install exited with code 1")]
    fake.fail_downs = 1  # and the first teardown request is refused
    with pytest.raises(Exception, match="setup failed: pip install exited with code 1"):
        await backend.launch("svc", 1, 1, make_spec())
    await until(lambda: fake.names() == [], timeout=10, what="the cluster torn down")


def test_cluster_names_of_two_deployments_never_collide() -> None:
    # Issue 24: with `-` joining the parts, both were "sluice-prod-llm-r1-v1".
    assert cluster_name("sluice-prod", "llm", 1, 1) != cluster_name("sluice", "prod-llm", 1, 1)
    for ns, svc in (("sluice-prod", "llm"), ("sluice", "prod-llm")):
        name = cluster_name(ns, svc, 1, 1)
        assert CLUSTER_NAME_RE.fullmatch(name), name
        other = ("sluice", "prod-llm") if ns == "sluice-prod" else ("sluice-prod", "llm")
        assert parse_cluster(cluster_prefix(*other), name) is None


async def test_a_deployment_never_adopts_nor_sweeps_anothers_clusters(
    fake: FakeSkyPilot, caplog: pytest.LogCaptureFixture
) -> None:
    """Against the fake SkyPilot: the default deployment (namespace `sluice`) with service
    `prod-llm` beside deployment `sluice-prod` with service `llm`, on one SkyPilot user."""
    prod = SkyPilotBackend(dataclasses.replace(FAST, namespace="sluice-prod"), sdk=fake)
    await prod.start()
    try:
        theirs = await prod.launch("llm", 1, 1, make_spec())
    finally:
        await prod.aclose()
    default = SkyPilotBackend(dataclasses.replace(FAST, namespace="sluice"), sdk=fake)
    await default.start()
    try:
        caplog.set_level("WARNING")
        assert default.recover("prod-llm", 1) is None  # not its cluster, not its URL
        default.sweep({"prod-llm": set()})  # "its service is gone" must not reach theirs
        default.sweep({})
        mine = await default.launch("prod-llm", 1, 1, make_spec())
        assert mine.handle["cluster"] != theirs.handle["cluster"]
        default.sweep({"prod-llm": {1}})
        # sweep() decides (and logs each teardown it starts) synchronously.
        assert "tearing down" not in caplog.text, caplog.text
        assert theirs.handle["cluster"] in fake.up_names()
    finally:
        await default.aclose()
