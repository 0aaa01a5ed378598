"""The service spec: Sky Serve's fields, defaults and rules; the examples."""

from __future__ import annotations

import http.client
import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from controlplane.servicespec import (
    ReadinessProbe,
    ReplicaPolicy,
    ServiceSpec,
    SpecError,
    is_count_only_change,
    load_spec,
    parse_spec,
    port_ranges,
)
from proxy.wire.policies import POLICY_NAMES
from tests.support.ports import free_port
from tests.support.processes import REPO

EXAMPLES = REPO / "examples"
AUTOSCALE = {"min_replicas": 1, "max_replicas": 3, "target_qps_per_replica": 2}


def spec_with(**overrides: Any) -> dict[str, Any]:
    """A valid service YAML (as a mapping) with top-level keys replaced."""
    base: dict[str, Any] = {
        "service": {"readiness_probe": "/health", "replicas": 2},
        "run": "python3 server.py",
    }
    base.update(overrides)
    return base


def service_with(**fields: Any) -> dict[str, Any]:
    return spec_with(service={"readiness_probe": "/health", **fields})


def error_of(mapping: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(mapping)
    return info.value


# ---------------------------------------------------------------------------
# Validation: every rule names the field path.

# (id, the path the error names, a fragment of its reason, the mapping)
INVALID = [pytest.param(mapping, path, fragment, id=case) for case, path, fragment, mapping in [
    ("replicas-and-replica_policy", "$.service.replicas", "cannot be combined with replica_policy",
     service_with(replicas=2, replica_policy={"min_replicas": 1})),
    ("max-below-min", "$.service.replica_policy.max_replicas", "must be >= min_replicas (3), got 2",
     service_with(
         replica_policy={"min_replicas": 3, "max_replicas": 2, "target_qps_per_replica": 1}
     )),
    ("target_qps-without-max", "$.service.replica_policy.max_replicas",
     "must be set where target_qps_per_replica is set",
     service_with(replica_policy={"min_replicas": 1, "target_qps_per_replica": 5})),
    ("target_ongoing-without-max", "$.service.replica_policy.max_replicas",
     "must be set where target_ongoing_requests is set",
     service_with(replica_policy={"min_replicas": 1, "target_ongoing_requests": 4})),
    ("target_queue-without-max", "$.service.replica_policy.max_replicas",
     "must be set where target_queue_length_per_replica is set",
     service_with(replica_policy={"min_replicas": 1, "target_queue_length_per_replica": 4})),
    ("queue-and-ongoing", "$.service.replica_policy.target_queue_length_per_replica",
     "cannot be combined with target_ongoing_requests",
     service_with(replica_policy={"min_replicas": 1, "max_replicas": 3,
                                  "target_ongoing_requests": 2,
                                  "target_queue_length_per_replica": 4})),
    ("queue-target-zero", "$.service.replica_policy.target_queue_length_per_replica", "",
     service_with(replica_policy={"min_replicas": 1, "max_replicas": 3,
                                  "target_queue_length_per_replica": 0})),
    ("scrape-interval-too-short", "$.service.sluice.engine_metrics.interval_seconds", "",
     service_with(sluice={"engine_metrics": {"interval_seconds": 0.05}})),
    ("metrics-path-not-absolute", "$.service.sluice.engine_metrics.path", "",
     service_with(sluice={"engine_metrics": {"path": "metrics"}})),
    ("metrics-unknown-field", "$.service.sluice.engine_metrics.host", "",
     service_with(sluice={"engine_metrics": {"host": "10.0.0.1"}})),
    ("metrics-port-zero", "$.service.sluice.engine_metrics.port", "",
     service_with(sluice={"engine_metrics": {"port": 0}})),
    ("min-max-differ-without-target", "$.service.replica_policy.target_qps_per_replica",
     "differ but no autoscaling target",
     service_with(replica_policy={"min_replicas": 1, "max_replicas": 3})),
    ("both-autoscaling-targets", "$.service.replica_policy.target_ongoing_requests",
     "cannot be combined with target_qps_per_replica",
     service_with(
         replica_policy={
             "min_replicas": 1,
             "max_replicas": 3,
             "target_qps_per_replica": 2,
             "target_ongoing_requests": 4,
         }
     )),
    ("qps-map-without-instance-aware", "$.service.replica_policy.target_qps_per_replica",
     "needs load_balancing_policy: instance_aware_least_load (got least_load)",
     service_with(
         replica_policy={**AUTOSCALE, "target_qps_per_replica": {"A100": 5, "H100:1": 9}}
     )),
    ("instance-aware-with-number", "$.service.load_balancing_policy",
     "needs replica_policy.target_qps_per_replica as a per-accelerator map",
     service_with(replica_policy=AUTOSCALE, load_balancing_policy="instance_aware_least_load")),
    ("instance-aware-without-target", "$.service.load_balancing_policy", "got None",
     service_with(replicas=2, load_balancing_policy="instance_aware_least_load")),
    ("unknown-policy", "$.service.load_balancing_policy",
     "unknown policy 'fastest'; expected one of least_load, round_robin",
     service_with(load_balancing_policy="fastest")),
    ("probe-string-without-slash", "$.service.readiness_probe", "must start with '/', got 'health'",
     spec_with(service={"readiness_probe": "health"})),
    ("probe-path-without-slash", "$.service.readiness_probe.path",
     "must start with '/', got 'v1/models'",
     spec_with(service={"readiness_probe": {"path": "v1/models"}})),
    ("probe-object-without-path", "$.service.readiness_probe.path", "required field is missing",
     spec_with(service={"readiness_probe": {"initial_delay_seconds": 5}})),
    ("post_data-not-json", "$.service.readiness_probe.post_data", "not valid JSON",
     spec_with(service={"readiness_probe": {"path": "/", "post_data": "{model: x}"}})),
    ("probe-timeout-zero", "$.service.readiness_probe.timeout_seconds", "> 0.0, got 0",
     spec_with(service={"readiness_probe": {"path": "/", "timeout_seconds": 0}})),
    ("probe-header-not-str", "$.service.readiness_probe.headers.X-Key", "Expected `str`, got `int`",
     spec_with(service={"readiness_probe": {"path": "/", "headers": {"X-Key": 5}}})),
    ("service-port-too-high", "$.service.ports", "<= 65535, got 70000",
     service_with(ports=70000)),
    ("service-port-zero", "$.service.ports", ">= 1, got 0",
     service_with(ports=0)),
    ("resources-port-range-reversed", "$.resources.ports", "ranges ascending",
     spec_with(resources={"ports": "9000-8000"})),
    ("resources-port-out-of-range", "$.resources.ports", "within 1-65535",
     spec_with(resources={"ports": 65536})),
    ("several-ports-without-service-ports", "$.resources.ports", "set service.ports",
     spec_with(resources={"ports": [8080, 8081]})),
    ("negative-replicas", "$.service.replicas", ">= 0, got -1",
     service_with(replicas=-1)),
    ("replicas-not-int", "$.service.replicas", "got `str`",
     service_with(replicas="2")),
    ("replica_policy-without-min", "$.service.replica_policy.min_replicas",
     "required field is missing",
     service_with(replica_policy={"max_replicas": 2})),
    ("target_qps-zero", "$.service.replica_policy.target_qps_per_replica", "> 0.0",
     service_with(replica_policy={**AUTOSCALE, "target_qps_per_replica": 0})),
    ("qps-map-bad-accelerator", "$.service.replica_policy.target_qps_per_replica.A 100",
     "invalid key",
     service_with(
         replica_policy={**AUTOSCALE, "target_qps_per_replica": {"A 100": 5}},
         load_balancing_policy="instance_aware_least_load",
     )),
    ("unknown-spot-placer", "$.service.replica_policy.spot_placer", "Invalid enum value 'cheapest'",
     service_with(replica_policy={"min_replicas": 1, "spot_placer": "cheapest"})),
    ("fallback-without-spot", "$.service.replica_policy.dynamic_ondemand_fallback",
     "set resources.use_spot: true",
     service_with(replica_policy={"min_replicas": 1, "dynamic_ondemand_fallback": True})),
    ("base-fallback-without-spot", "$.service.replica_policy.base_ondemand_fallback_replicas",
     "set resources.use_spot: true",
     service_with(replica_policy={"min_replicas": 2, "base_ondemand_fallback_replicas": 1})),
    ("spot-placer-without-spot", "$.service.replica_policy.spot_placer",
     "set resources.use_spot: true",
     service_with(replica_policy={"min_replicas": 1, "spot_placer": "dynamic_fallback"})),
    ("stream-timeout-negative", "$.service.load_balancer.stream_timeout_seconds", "> 0.0, got -1",
     service_with(load_balancer={"stream_timeout_seconds": -1})),
    ("tls-without-certfile", "$.service.tls.certfile", "required field is missing",
     service_with(tls={"keyfile": "key.pem"})),
    ("service-typo", "$.service.replica_polcy", "did you mean `replica_policy`?",
     service_with(replica_polcy={"min_replicas": 1})),
    ("pool-workers", "$.service.workers", "not supported",
     service_with(workers=2)),
    ("pool", "$.pool", "cluster pools",
     spec_with(pool={"workers": 2})),
    ("inputs", "$.inputs", "unused by Sky Serve",
     spec_with(inputs={"s3://bucket": 1})),
    ("top-level-typo", "$.rnu", "did you mean `run`?",
     spec_with(rnu="oops")),
    ("resources-typo", "$.resources.use_spto", "did you mean `use_spot`?",
     spec_with(resources={"use_spto": True})),
    ("accelerator-count-not-number", "$.resources.accelerators.A100", "got `str`",
     spec_with(resources={"accelerators": {"A100": "eight"}})),
    ("no-nodes", "$.num_nodes", "Expected `int` >= 1",
     spec_with(num_nodes=0)),
    ("env-without-value", "$.envs.MODEL", "has no value",
     spec_with(envs={"MODEL": None})),
    ("env-boolean", "$.envs.DEBUG", "quote it ('true')",
     spec_with(envs={"DEBUG": True})),
    ("env-bad-name", "$.envs.2BAD", "invalid key",
     spec_with(envs={"OK": "1", "2BAD": "x"})),
    ("secret-without-value", "$.secrets.HF_TOKEN", "has no value",
     spec_with(secrets={"HF_TOKEN": None})),
    ("no-service-section", "$.service", "required field is missing",
     {"run": "x"}),
    ("empty-service-section", "$.service", "got `null`",
     {"service": None}),
    ("empty-document", "$", "expected a mapping",
     None),
    ("not-a-mapping", "$", "got list",
     ["service"]),
]]  # fmt: skip


@pytest.mark.parametrize(("mapping", "path", "fragment"), INVALID)
def test_invalid_spec_names_the_field(mapping: Any, path: str, fragment: str) -> None:
    err = error_of(mapping)
    assert err.path == path
    assert fragment in err.reason
    assert str(err).startswith(f"{path}: ")
    assert isinstance(err, ValueError)


def test_error_from_a_file_names_the_file_then_the_path(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("service:\n  replicas: 2\n  replica_policy: {min_replicas: 1}\n")
    with pytest.raises(SpecError) as info:
        load_spec(f)
    assert str(info.value).startswith(f"{f}: $.service.replicas: ")
    assert info.value.source == str(f)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("service:\n  replicas: [1\n", "invalid YAML", id="syntax"),
        pytest.param("service:\n  replicas: 1\n  replicas: 2\n", "duplicate key", id="dup"),
        pytest.param("a: 1\n---\nb: 2\n", "invalid YAML", id="two-documents"),
        pytest.param("service: {}\nconfig: &x {a: *x}\n", "alias contains itself", id="cycle"),
        pytest.param(
            "service: {}\nconfig:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 7)),
            "once aliases are expanded",
            id="alias-bomb",
        ),
        pytest.param("service: " + "[" * 500 + "]" * 500 + "\n", "nested too deeply", id="deep"),
    ],
)
def test_invalid_yaml(text: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(text)
    assert info.value.path == "$"
    assert fragment in info.value.reason


def test_missing_file() -> None:
    with pytest.raises(SpecError, match=r"nope\.yaml: \$: cannot read the file"):
        load_spec("nope.yaml")


# ---------------------------------------------------------------------------
# Defaults and the two forms of readiness_probe and replicas.


def test_sky_serve_defaults() -> None:
    spec = parse_spec({"service": {}})
    assert spec.readiness_path == "/"
    assert spec.min_replicas == spec.max_replicas == 1
    assert not spec.autoscaling
    probe = spec.probe
    assert probe.initial_delay_seconds == 1200
    assert probe.timeout_seconds == 15
    assert probe.endpoint_probe_interval_seconds == 10
    assert probe.consecutive_failure_threshold_timeout == 180
    assert probe.post_data is None and probe.post_body is None and probe.headers == {}
    scaling = spec.service.scaling
    assert scaling.upscale_delay_seconds == 300
    assert scaling.downscale_delay_seconds == 1200
    assert scaling.num_overprovision == 0
    assert scaling.base_ondemand_fallback_replicas == 0
    assert not scaling.dynamic_ondemand_fallback and not scaling.uses_ondemand_fallback
    assert scaling.spot_placer is None
    assert spec.service.load_balancing_policy == "least_load"
    assert spec.service.load_balancer.stream_timeout_seconds == 120
    assert spec.service.ports is None and spec.service.tls is None
    assert spec.run is None and spec.envs == {} and spec.num_nodes == 1
    assert spec.resources.use_spot is False and spec.replica_port is None


def test_readiness_probe_string_is_the_path_with_defaults() -> None:
    short = parse_spec(service_with())
    long = parse_spec(spec_with(service={"readiness_probe": {"path": "/health"}, "replicas": 2}))
    assert short.service.readiness_probe == "/health"
    assert short.probe == long.probe == ReadinessProbe(path="/health")
    assert short.readiness_path == long.readiness_path == "/health"


def test_readiness_probe_object() -> None:
    spec = parse_spec(
        spec_with(
            service={
                "readiness_probe": {
                    "path": "/v1/models",
                    "initial_delay_seconds": 30,
                    "timeout_seconds": 2.5,
                    "endpoint_probe_interval_seconds": 1,
                    "consecutive_failure_threshold_timeout": 20,
                    "post_data": {"model": "m", "max_tokens": 1},
                    "headers": {"Authorization": "Bearer x"},
                }
            }
        )
    )
    probe = spec.probe
    assert (probe.path, probe.initial_delay_seconds, probe.timeout_seconds) == (
        "/v1/models",
        30,
        2.5,
    )
    assert probe.endpoint_probe_interval_seconds == 1
    assert probe.consecutive_failure_threshold_timeout == 20
    assert json.loads(probe.post_body or b"") == {"model": "m", "max_tokens": 1}
    assert probe.headers == {"Authorization": "Bearer x"}


def test_post_data_as_json_string_is_sent_verbatim() -> None:
    text = '{"prompt": "hi", "max_tokens": 1}'
    spec = parse_spec(spec_with(service={"readiness_probe": {"path": "/", "post_data": text}}))
    assert spec.probe.post_body == text.encode()


def test_replicas_shorthand_is_a_fixed_policy() -> None:
    spec = parse_spec(service_with(replicas=3))
    assert spec.service.scaling == ReplicaPolicy(min_replicas=3)
    assert spec.min_replicas == spec.max_replicas == 3
    assert parse_spec(service_with(replicas=0)).max_replicas == 0


def test_replica_policy_fields() -> None:
    spec = parse_spec(
        spec_with(
            service={
                "readiness_probe": "/",
                "replica_policy": {
                    "min_replicas": 1,
                    "max_replicas": 4,
                    "num_overprovision": 1,
                    "target_qps_per_replica": 2.5,
                    "upscale_delay_seconds": 10,
                    "downscale_delay_seconds": 20,
                    "base_ondemand_fallback_replicas": 1,
                    "dynamic_ondemand_fallback": True,
                    "spot_placer": "dynamic_fallback",
                },
            },
            resources={"use_spot": True, "accelerators": "A100:1"},
        )
    )
    scaling = spec.service.scaling
    assert (spec.min_replicas, spec.max_replicas, spec.autoscaling) == (1, 4, True)
    assert scaling.num_overprovision == 1 and scaling.uses_ondemand_fallback
    assert (scaling.upscale_delay_seconds, scaling.downscale_delay_seconds) == (10, 20)
    assert scaling.target_qps_for("A100:1") == scaling.target_qps_for(None) == 2.5


def test_equal_min_max_needs_no_target() -> None:
    spec = parse_spec(service_with(replica_policy={"min_replicas": 2, "max_replicas": 2}))
    assert spec.min_replicas == spec.max_replicas == 2 and not spec.autoscaling


def test_concurrency_target_is_an_autoscaling_signal() -> None:
    spec = parse_spec(
        service_with(
            replica_policy={"min_replicas": 1, "max_replicas": 5, "target_ongoing_requests": 8}
        )
    )
    assert spec.autoscaling and spec.service.scaling.target_ongoing_requests == 8


def test_per_accelerator_target_qps() -> None:
    spec = parse_spec(
        service_with(
            replica_policy={
                **AUTOSCALE,
                "target_qps_per_replica": {"A100": 5, "H100:1": 9, "A100-80GB:1": 7},
            },
            load_balancing_policy="instance_aware_least_load",
        )
    )
    scaling = spec.service.scaling
    assert scaling.target_qps_for("A100:1") == 5  # by base name
    assert scaling.target_qps_for("H100:1") == 9  # exact
    assert scaling.target_qps_for("A100-80GB:1") == 7
    assert scaling.target_qps_for("T4") is None
    assert scaling.target_qps_for(None) is None


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_is_accepted(policy: str) -> None:
    service: dict[str, Any] = {"load_balancing_policy": policy, "replicas": 1}
    if policy == "instance_aware_least_load":
        service = {
            "load_balancing_policy": policy,
            "replica_policy": {**AUTOSCALE, "target_qps_per_replica": {"A100": 1}},
        }
    assert parse_spec(service_with(**service)).service.load_balancing_policy == policy


def test_task_fields() -> None:
    spec = parse_spec(
        spec_with(
            name="llm",
            setup="pip install x",
            envs={"MODEL": "m", "BATCH": 8, "LR": 0.5},
            secrets={"HF_TOKEN": "t"},
            workdir="~/app",
            resources={
                "accelerators": {"A100": 8},
                "use_spot": True,
                "ports": 8081,
                "cpus": "4+",
                "memory": 32,
                "infra": "k8s",
                "any_of": [{"cloud": "aws"}, {"cloud": "gcp"}],
            },
            file_mounts={"/data": "s3://bucket"},
            config={"kubernetes": {"pod_config": {}}},
        )
    )
    assert spec.name == "llm" and spec.setup == "pip install x"
    assert spec.envs == {"MODEL": "m", "BATCH": "8", "LR": "0.5"}  # numbers stringified
    assert spec.secrets == {"HF_TOKEN": "t"}
    assert spec.workdir == "~/app"
    assert spec.resources.accelerators == {"A100": 8}
    assert spec.resources.use_spot and spec.resources.cpus == "4+"
    assert spec.replica_port == 8081
    assert spec.file_mounts == {"/data": "s3://bucket"}


def test_service_port_wins_over_resources_ports() -> None:
    spec = parse_spec(spec_with(service={"ports": 8081}, resources={"ports": [8080, "8081-8082"]}))
    assert spec.replica_port == 8081


def test_port_ranges() -> None:
    assert port_ranges(None) == ()
    assert port_ranges(8080) == ((8080, 8080),)
    assert port_ranges("8000-8010") == ((8000, 8010),)
    assert port_ranges([80, "443", "9000-9001"]) == ((80, 80), (443, 443), (9000, 9001))
    with pytest.raises(ValueError, match="ports:"):
        port_ranges("http")


def test_load_spec_accepts_a_path_a_str_path_and_text(tmp_path: Path) -> None:
    text = "service:\n  readiness_probe: /health\n  replicas: 2\nrun: echo hi\n"
    f = tmp_path / "svc.yaml"
    f.write_text(text)
    assert load_spec(f) == load_spec(str(f)) == load_spec(text)
    assert load_spec("{service: {replicas: 2}}").min_replicas == 2  # flow style


# ---------------------------------------------------------------------------
# JSON round trip (what Redis holds).


def test_json_round_trip_of_a_full_spec() -> None:
    spec = parse_spec(
        spec_with(
            service={
                "readiness_probe": {
                    "path": "/h",
                    "post_data": {"a": [1, 2]},
                    "headers": {"K": "v"},
                },
                "replica_policy": {**AUTOSCALE, "target_qps_per_replica": {"A100": 5}},
                "load_balancing_policy": "instance_aware_least_load",
                "load_balancer": {"stream_timeout_seconds": 30},
                "ports": 8080,
                "tls": {"keyfile": "k.pem", "certfile": "c.pem"},
            },
            envs={"N": 1},
            resources={"accelerators": ["A100", "H100"], "labels": {"team": "ml"}},
            file_mounts={"/d": {"source": "s3://b", "mode": "MOUNT"}},
        )
    )
    data = spec.to_json()
    assert isinstance(data, bytes)
    assert ServiceSpec.from_json(data) == spec
    assert ServiceSpec.from_json(data.decode()) == spec


def test_yaml_values_are_normalised_to_what_json_holds() -> None:
    # A YAML date in a free-form section would not survive JSON as a date.
    spec = load_spec("service: {replicas: 1}\nconfig: {since: 2024-01-02}\n")
    assert spec.config == {"since": "2024-01-02"}
    assert ServiceSpec.from_json(spec.to_json()) == spec


def test_from_json_validates_again() -> None:
    with pytest.raises(SpecError) as info:
        ServiceSpec.from_json(
            b'{"service": {"replicas": 1, "replica_policy": {"min_replicas": 1}}}'
        )
    assert info.value.path == "$.service.replicas"
    assert info.value.source == "stored spec"
    with pytest.raises(SpecError, match="not valid JSON"):
        ServiceSpec.from_json(b"{")


def test_structs_are_frozen() -> None:
    spec = parse_spec(service_with())
    with pytest.raises(AttributeError):
        spec.run = "other"  # type: ignore[misc]


# ---------------------------------------------------------------------------
# Count-only changes: relabel instead of replace.


BASE = spec_with(
    service={"readiness_probe": "/health", "replicas": 2, "ports": 8080},
    envs={"MODEL": "m"},
    resources={"accelerators": "A100:1", "ports": 8080},
    setup="pip install app",
)


def _variant(**top: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(BASE))
    for key, value in top.items():
        if key == "service":
            out["service"].update(value)
        else:
            out[key] = value
    return out


COUNT_ONLY = [
    pytest.param(_variant(), id="identical"),
    pytest.param(_variant(service={"replicas": 3}), id="replicas"),
    pytest.param(
        _variant(service={"replicas": None, "replica_policy": AUTOSCALE}), id="replicas-to-policy"
    ),
    pytest.param(
        _variant(
            service={
                "replicas": None,
                "replica_policy": {**AUTOSCALE, "upscale_delay_seconds": 5},
            }
        ),
        id="policy-knobs",
    ),
    pytest.param(
        _variant(service={"readiness_probe": {"path": "/ready", "timeout_seconds": 3}}),
        id="readiness-probe",
    ),
    pytest.param(_variant(service={"load_balancing_policy": "round_robin"}), id="lb-policy"),
    pytest.param(
        _variant(service={"load_balancer": {"stream_timeout_seconds": 10}}), id="lb-timeout"
    ),
    pytest.param(_variant(service={"tls": {"keyfile": "k", "certfile": "c"}}), id="tls"),
    pytest.param(_variant(name="renamed"), id="name"),
]

REPLACE = [
    pytest.param(_variant(run="python3 other.py"), id="run"),
    pytest.param(_variant(setup="pip install app==2"), id="setup"),
    pytest.param(_variant(envs={"MODEL": "m2"}), id="envs"),
    pytest.param(_variant(secrets={"TOKEN": "x"}), id="secrets"),
    pytest.param(_variant(workdir="./app"), id="workdir"),
    pytest.param(
        _variant(resources={"accelerators": "H100:1", "ports": 8080}), id="resources-accelerators"
    ),
    pytest.param(
        _variant(resources={"accelerators": "A100:1", "ports": 8080, "use_spot": True}),
        id="resources-use_spot",
    ),
    pytest.param(
        _variant(service={"ports": 9090}, resources={"accelerators": "A100:1", "ports": 9090}),
        id="ports",
    ),
    pytest.param(  # the port must be opened (Sky Serve's rule); the replica's port moves
        _variant(service={"ports": 8081}, resources={"accelerators": "A100:1",
                                                     "ports": [8080, 8081]}),
        id="service-ports-moves",
    ),
    pytest.param(_variant(file_mounts={"/data": "s3://b"}), id="file_mounts"),
    pytest.param(_variant(config={"kubernetes": {"pod_config": {}}}), id="config"),
]


@pytest.mark.parametrize("new", COUNT_ONLY)
def test_count_only_change(new: dict[str, Any]) -> None:
    old = parse_spec(BASE)
    assert is_count_only_change(old, parse_spec(new))
    assert is_count_only_change(parse_spec(new), old)


@pytest.mark.parametrize("new", REPLACE)
def test_change_that_replaces_replicas(new: dict[str, Any]) -> None:
    old = parse_spec(BASE)
    assert not is_count_only_change(old, parse_spec(new))
    assert not is_count_only_change(parse_spec(new), old)


def test_count_only_survives_the_redis_round_trip() -> None:
    old = ServiceSpec.from_json(parse_spec(BASE).to_json())
    assert is_count_only_change(old, parse_spec(_variant(service={"replicas": 5})))


def test_every_spec_field_is_classified() -> None:
    # A new top-level field is compared (forces replacement) unless listed
    # here on purpose; this test makes adding one a conscious decision.
    top = {f.name for f in msgspec.structs.fields(ServiceSpec)}
    assert top == {
        "service",
        "name",
        "run",
        "setup",
        "envs",
        "secrets",
        "workdir",
        "resources",
        "num_nodes",
        "file_mounts",
        "config",
        "volumes",
    }


# ---------------------------------------------------------------------------
# The examples: they parse, and their servers answer as real processes.


@pytest.mark.parametrize("name", ["echo.yaml", "llm_sse.yaml"])
def test_examples_parse(name: str) -> None:
    spec = load_spec(EXAMPLES / name)
    assert spec.readiness_path == "/health"
    assert spec.run and spec.workdir == "examples"
    assert (REPO / spec.workdir / spec.run.split()[-1]).is_file()
    assert ServiceSpec.from_json(spec.to_json()) == spec


def test_llm_example_autoscales() -> None:
    spec = load_spec(EXAMPLES / "llm_sse.yaml")
    assert (spec.min_replicas, spec.max_replicas) == (1, 3)
    assert spec.service.scaling.target_qps_per_replica == 5


def _start_replica(example: str, extra_env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Run an example's `run:` in its workdir like the local backend does, and
    wait (bounded) for the line it prints once it is listening."""
    spec = load_spec(EXAMPLES / example)
    assert spec.run and spec.workdir
    port = free_port()
    env = {
        **os.environ,
        **spec.envs,
        **extra_env,
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "SLUICE_REPLICA_ID": "7",
    }
    proc = subprocess.Popen(
        ["bash", "-c", spec.run],
        cwd=REPO / spec.workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, stopped by its pid
    )
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 10
        line = b""
        while b"listening on" not in line:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                _stop(proc)
                pytest.fail(f"{example}: replica did not start within 10 s")
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"{example}: replica exited with {proc.returncode}")
    return proc, port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def replica() -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(example: str, **extra_env: str) -> int:
        proc, port = _start_replica(example, extra_env)
        started.append(proc)
        return port

    yield start
    for proc in started:
        _stop(proc)
        assert proc.returncode is not None


def test_echo_example_serves(replica: Any) -> None:
    port = replica("echo.yaml")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200
        assert json.loads(health.read())["status"] == "ok"
        # Same connection: HTTP/1.1 keep-alive.
        conn.request("POST", "/v1/anything?x=1", body=b"hello", headers={"X-Test": "1"})
        echo = conn.getresponse()
        assert echo.status == 200 and echo.getheader("X-Replica-Id") == "7"
        assert json.loads(echo.read()) == {
            "replica": "7",
            "method": "POST",
            "path": "/v1/anything?x=1",
            "body": "hello",
        }
        # A chunked request body, as a streaming proxy may send it.
        conn.putrequest("PUT", "/chunked")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        chunked = conn.getresponse()
        assert json.loads(chunked.read())["body"] == "abcde"
    finally:
        conn.close()


def test_llm_example_streams_sse(replica: Any) -> None:
    port = replica("llm_sse.yaml", TOKEN_DELAY="0.001", LOAD_SECONDS="0")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        health = conn.getresponse()
        health.read()
        assert health.status == 200
        request = {"stream": True, "messages": [{"role": "user", "content": "hello there world"}]}
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(request),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "text/event-stream"
        assert resp.getheader("Transfer-Encoding") == "chunked"
        events = [
            line.removeprefix(b"data: ")
            for line in resp.read().split(b"\n\n")
            if line.startswith(b"data: ")
        ]
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == "hello there world "
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # Keep-alive after a stream, and the non-streaming form.
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**request, "stream": False}))
        whole = conn.getresponse()
        body = json.loads(whole.read())
        assert body["choices"][0]["message"]["content"] == "hello there world "
    finally:
        conn.close()


def test_llm_example_is_not_ready_while_loading(replica: Any) -> None:
    port = replica("llm_sse.yaml", LOAD_SECONDS="30")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 503
    finally:
        conn.close()


# -- $VAR substitution from envs and secrets (SkyPilot's Task.from_yaml_config) --------------


def _sky_fill_in_env_vars(section: Any, values: dict[str, str]) -> Any:
    """SkyPilot 0.14.1's `sky/task.py::_fill_in_env_vars`, verbatim: the oracle."""
    import re

    text = json.dumps(section)
    pattern = r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?"
    return json.loads(re.sub(pattern, lambda m: values.get(m.group(1), m.group(0)), text))


LLM_PROBE = {
    "path": "/v1/chat/completions",
    "post_data": {
        "model": "$MODEL_NAME",
        "messages": [{"role": "user", "content": "Hi ${MODEL_NAME}, $UNKNOWN, cost $5"}],
        "max_tokens": 1,
    },
    "headers": {"Authorization": "Bearer ${API_KEY}"},
}


def test_env_vars_fill_the_service_section_as_sky_does() -> None:
    doc = spec_with(
        envs={"MODEL_NAME": "meta-llama/Llama-3-8B", "ROOT": "/srv"},
        secrets={"API_KEY": "sk-1"},
        service={"readiness_probe": LLM_PROBE, "replicas": 1},
        workdir="$ROOT/app",
        file_mounts={"/models/${MODEL_NAME}": "s3://b/$MODEL_NAME"},
    )
    spec = parse_spec(doc)
    probe = spec.probe
    assert probe.post_data == {
        "model": "meta-llama/Llama-3-8B",
        "messages": [{"role": "user", "content": "Hi meta-llama/Llama-3-8B, $UNKNOWN, cost $5"}],
        "max_tokens": 1,
    }
    assert probe.headers == {"Authorization": "Bearer sk-1"}  # secrets fill in too
    assert spec.workdir == "/srv/app"
    assert spec.file_mounts == {"/models/meta-llama/Llama-3-8B": "s3://b/meta-llama/Llama-3-8B"}
    assert spec.run == doc["run"]  # run/setup read their env at run time: left alone
    values = {"MODEL_NAME": "meta-llama/Llama-3-8B", "ROOT": "/srv", "API_KEY": "sk-1"}
    expected = _sky_fill_in_env_vars(LLM_PROBE, values)
    assert probe.post_data == expected["post_data"] and probe.headers == expected["headers"]


@pytest.mark.parametrize(
    "text",
    ["$A", "${A}", "x$A-y", "$A$B", "${A", "$A}", "$$A", "${A}}", "$1A", "$AB", "a $ b",
     "$A_B", "${ A }", "$Ä", "$caf\u00e9"],
)  # fmt: skip
def test_substitution_matches_skys_regex_on_edge_cases(text: str) -> None:
    values = {"A": "1", "B": "2", "A_B": "3", "caf": "4"}
    section = {"readiness_probe": {"path": "/h", "post_data": {"k": text}}}
    ours = parse_spec(spec_with(envs=values, service={**section, "replicas": 1}))
    assert ours.probe.post_data == _sky_fill_in_env_vars(section, values)["readiness_probe"][
        "post_data"
    ]


def test_substitution_survives_quotes_that_break_skys_json_text() -> None:
    spec = parse_spec(
        spec_with(
            envs={"PROMPT": 'say "hi"\\n'},
            service={"readiness_probe": {"path": "/h", "post_data": {"p": "$PROMPT"}}},
        )
    )
    assert spec.probe.post_data == {"p": 'say "hi"\\n'}


def test_cli_envs_and_secrets_override_the_yaml_before_substitution(tmp_path: Path) -> None:
    path = tmp_path / "svc.yaml"
    path.write_text(
        "service:\n  readiness_probe:\n    path: /h\n    post_data: {model: $MODEL}\n"
        "envs:\n  MODEL: small\n  HF_TOKEN:\nsecrets:\n  KEY: yaml\nrun: serve\n"
    )
    with pytest.raises(SpecError, match=r"\$\.envs\.HF_TOKEN: has no value"):
        load_spec(path)
    spec = load_spec(path, envs={"MODEL": "big", "HF_TOKEN": "t"}, secrets={"KEY": "cli"})
    assert spec.probe.post_data == {"model": "big"}
    assert spec.envs == {"MODEL": "big", "HF_TOKEN": "t"} and spec.secrets == {"KEY": "cli"}


# ---------------------------------------------------------------------------
# service.sluice.prefix: the prefix policy's options (sluice-only, optional).


def test_prefix_options_reach_the_spec_and_default_without_them() -> None:
    from proxy.wire.snapshot import PrefixOptions

    spec = parse_spec(service_with(replicas=2, load_balancing_policy="prefix", sluice={
        "prefix": {"epsilon": 0.75, "session_header": "X-Conversation", "user_field": True,
                   "spill_margin": 8, "warm_copies": False}}))
    assert spec.prefix_options == PrefixOptions(epsilon=0.75, session_header="X-Conversation",
                                                user_field=True, spill_margin=8,
                                                warm_copies=False)
    # A Sky Serve YAML has no `sluice:` key: the defaults (warm copies on).
    plain = parse_spec(service_with(replicas=2, load_balancing_policy="prefix"))
    assert plain.prefix_options == PrefixOptions()
    assert plain.prefix_options.warm_copies
    assert parse_spec(service_with(replicas=2)).prefix_options is None  # another policy
    assert ServiceSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("sluice", "path"),
    [
        ({"prefix": {"epsilon": 0}}, "$.service.sluice.prefix.epsilon"),
        ({"prefix": {"spill_margin": -1}}, "$.service.sluice.prefix.spill_margin"),
        ({"prefix": {"spill_margin": 1.5}}, "$.service.sluice.prefix.spill_margin"),
        ({"prefix": {"spill_margin": "16"}}, "$.service.sluice.prefix.spill_margin"),
        ({"prefix": {"bogus": 1}}, "$.service.sluice.prefix.bogus"),
        ({"prefix": {"warm_copies": "yes"}}, "$.service.sluice.prefix.warm_copies"),
        ({"prefix": {"block_bytes": 4096, "prefix_bytes": 1024}},
         "$.service.sluice.prefix.block_bytes"),
        ({"prefix": {"session_header": "Bad Header:"}}, "$.service.sluice.prefix.session_header"),
        ({"routing": {}}, "$.service.sluice.routing"),
    ],
)
def test_bad_prefix_options_name_the_field(sluice: dict[str, Any], path: str) -> None:
    err = error_of(service_with(replicas=1, load_balancing_policy="prefix", sluice=sluice))
    assert err.path == path, str(err)


def test_prefix_options_need_the_prefix_policy() -> None:
    err = error_of(service_with(replicas=1, sluice={"prefix": {"epsilon": 1}}))
    assert err.path == "$.service.sluice.prefix"
    assert "load_balancing_policy: prefix" in str(err)


def test_changing_prefix_options_is_a_count_only_change() -> None:
    old = parse_spec(service_with(replicas=2, load_balancing_policy="prefix"))
    new = parse_spec(service_with(replicas=3, load_balancing_policy="prefix",
                                  sluice={"prefix": {"epsilon": 1.0}}))
    assert is_count_only_change(old, new)


def test_resume_streams_is_opt_in_and_a_count_only_change() -> None:
    plain = parse_spec(service_with(replicas=2))
    assert plain.resume_streams is False
    on = parse_spec(service_with(replicas=2, sluice={"resume_streams": True}))
    assert on.resume_streams is True
    assert is_count_only_change(plain, on)  # the proxies' business: no replica replaced
    err = error_of(service_with(replicas=1, sluice={"resume_streams": "yes"}))
    assert err.path == "$.service.sluice.resume_streams"
