"""Differential test: sluice's verdict on service YAMLs against SkyPilot 0.14.1's own.

The corpus: real service YAMLs from SkyPilot's repository (skyserve_corpus/real, see its
PROVENANCE.md), each also with the --env/--secret values its usage comment asks for,
plus the field combinations and invalid specs of SYNTHETIC below. SkyPilot judges in its
own venv (.venv-sky, built by .ci/run; skyserve_judge.py runs `sky serve up`'s
client-side checks). sluice judges with `load_spec` and `backends.fit.check_backend`:

- for `--backend skypilot` every verdict must equal SkyPilot's, file by file, except
  the ones in DELIBERATE (each with its reason); and where both accept, every field
  sluice reads must hold SkyPilot's value (`_meaning`: same meaning, not just a yes);
- for the local backend, a spec SkyPilot accepts may be refused only for what a local
  process cannot be (LOCAL_LIMITS: the error names the field and `--backend skypilot`),
  and a spec SkyPilot refuses may be accepted only for a missing port (the local
  backend picks one).

Skipped, with one line, when the SkyPilot venv is missing. The judge runs offline: a
YAML whose verdict needs SkyPilot's catalog (a zone like `gcp/*/asia-northeast3-a` is
looked up on the network) is left out of the corpus (tests/skyserve/spot/spot_hedge.yaml).
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.backends.base import BackendError
from controlplane.backends.fit import check_backend
from controlplane.servicespec import ServiceSpec, SpecError, load_spec
from tests.support.processes import REPO

HERE = Path(__file__).parent
REAL = sorted((HERE / "skyserve_corpus" / "real").glob("*.yaml"))
JUDGE = HERE / "skyserve_judge.py"

# --env / --secret values a real file's usage asks for (`sky serve up ... --secret X`).
OVERRIDES: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "examples_serve_llama2_llama2.yaml": ({"HF_TOKEN": "hf_x"}, {}),
    "llm_llama-3_1_llama-3_1.yaml": ({}, {"HF_TOKEN": "hf_x"}),
    "tests_skyserve_llm_service.yaml": ({}, {"AUTH_TOKEN": "tok"}),
    "tests_skyserve_https_service.yaml": (
        {"TLS_KEYFILE_ENV_VAR": "key.pem", "TLS_CERTFILE_ENV_VAR": "cert.pem"}, {}),
}  # fmt: skip

_HTTP = "resources:\n  ports: 8080\nrun: python3 -m http.server 8080\n"

# label -> YAML text: every field combination sluice reads, valid and not.
SYNTHETIC: dict[str, str] = {
    "acc-null-counts": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  accelerators: {L4:1, A10G:1}\nrun: serve --port $PORT\n",
    "acc-names-only": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  accelerators: {L4, A10G, A100}\nrun: serve\n",
    "acc-counts": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  accelerators: {A100: 8}\nrun: serve\n",
    "acc-list": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  accelerators: [L4, A10G]\nrun: serve\n",
    "acc-any-of": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n  any_of:\n"
    "    - accelerators: L4\n    - accelerators: A10G:1\nrun: serve\n",
    "acc-ordered": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n  ordered:\n"
    "    - accelerators: L4\n    - accelerators: A10G\nrun: serve\n",
    "acc-negative": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  accelerators: {A100: -1}\nrun: serve\n",
    "multi-node": "service:\n  readiness_probe: /\n  replicas: 2\nnum_nodes: 2\n" + _HTTP,
    "zero-nodes": "service:\n  readiness_probe: /\nnum_nodes: 0\n" + _HTTP,
    "fixed-port-two-replicas": "service:\n  readiness_probe: /\n  replicas: 2\n" + _HTTP,
    "fixed-port-one-replica": "service:\n  readiness_probe: /\n  replicas: 1\n" + _HTTP,
    "port-env-two-replicas": "service:\n  readiness_probe: /\n  replicas: 2\n"
    "resources:\n  ports: 8080\nrun: python3 -m http.server $PORT\n",
    "no-run": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n",
    "no-port": "service:\n  readiness_probe: /\nrun: serve --port $PORT\n",
    "two-ports-no-service-port": "service:\n  readiness_probe: /\nresources:\n"
    "  ports: [8080, 8081]\nrun: serve\n",
    "port-range-no-service-port": "service:\n  readiness_probe: /\nresources:\n"
    "  ports: 8080-8081\nrun: serve\n",
    "two-ports-service-port": "service:\n  readiness_probe: /\n  ports: 8081\nresources:\n"
    "  ports: [8080, 8081]\nrun: serve\n",
    "no-service": "resources:\n  ports: 8080\nrun: serve\n",
    "replicas-and-policy": "service:\n  readiness_probe: /\n  replicas: 2\n  replica_policy:\n"
    "    min_replicas: 1\n" + _HTTP,
    "min-above-max": "service:\n  readiness_probe: /\n  replica_policy:\n    min_replicas: 3\n"
    "    max_replicas: 2\n    target_qps_per_replica: 1\n" + _HTTP,
    "qps-without-max": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    target_qps_per_replica: 1\n" + _HTTP,
    "max-without-qps": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    max_replicas: 3\n" + _HTTP,
    "autoscaled": "service:\n  readiness_probe: /\n  replica_policy:\n    min_replicas: 0\n"
    "    max_replicas: 3\n    target_qps_per_replica: 2.5\n    upscale_delay_seconds: 30\n"
    "    downscale_delay_seconds: 60\n" + _HTTP,
    "probe-object": "service:\n  readiness_probe:\n    path: /v1/models\n"
    "    initial_delay_seconds: 30\n    timeout_seconds: 5\n    post_data: {model: x}\n"
    "    headers: {Authorization: Bearer x}\n" + _HTTP,
    "probe-negative-delay": "service:\n  readiness_probe:\n    path: /\n"
    "    initial_delay_seconds: -1\n" + _HTTP,
    "probe-unknown-field": "service:\n  readiness_probe:\n    path: /\n    method: GET\n" + _HTTP,
    "policy-round-robin": "service:\n  readiness_probe: /\n"
    "  load_balancing_policy: round_robin\n" + _HTTP,
    "policy-unknown": "service:\n  readiness_probe: /\n  load_balancing_policy: fastest\n"
    + _HTTP,
    "instance-aware-map": "service:\n  readiness_probe: /\n"
    "  load_balancing_policy: instance_aware_least_load\n  replica_policy:\n"
    "    min_replicas: 1\n    max_replicas: 3\n    target_qps_per_replica: {L4: 2, A100: 5}\n"
    "resources:\n  ports: 8080\n  accelerators: {L4, A100}\nrun: serve\n",
    "qps-map-without-instance-aware": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    max_replicas: 3\n    target_qps_per_replica: {L4: 2}\n" + _HTTP,
    "fallback-without-spot": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    base_ondemand_fallback_replicas: 1\n" + _HTTP,
    "dynamic-fallback-spot": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    dynamic_ondemand_fallback: true\nresources:\n  ports: 8080\n"
    "  use_spot: true\nrun: serve --port $PORT\n",
    "mixed-spot-any-of": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  any_of:\n    - use_spot: true\n    - use_spot: false\nrun: serve\n",
    "job-recovery": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  job_recovery: EAGER_NEXT_REGION\nrun: serve\n",
    "env-values": "envs:\n  MODEL: x\n  SIZE: 7\n  EMPTY: ''\nservice:\n  readiness_probe:\n"
    "    path: /\n    post_data: {model: $MODEL}\n" + _HTTP,
    "env-without-value": "envs:\n  HF_TOKEN:\nservice:\n  readiness_probe: /\n" + _HTTP,
    "unknown-top-level": "service:\n  readiness_probe: /\nmodel: x\n" + _HTTP,
    "unknown-service-field": "service:\n  readiness_probe: /\n  replica: 2\n" + _HTTP,
    "unknown-resources-field": "service:\n  readiness_probe: /\nresources:\n  ports: 8080\n"
    "  gpu: L4\nrun: serve\n",
    "tls": "service:\n  readiness_probe: /\n  tls:\n    keyfile: k.pem\n    certfile: c.pem\n"
    + _HTTP,
    "stream-timeout": "service:\n  readiness_probe: /\n  load_balancer:\n"
    "    stream_timeout_seconds: 30\n" + _HTTP,
    "pool": "pool:\n  workers: 2\n" + _HTTP,
    "probe-timeout-zero": "service:\n  readiness_probe:\n    path: /\n    timeout_seconds: 0\n"
    + _HTTP,
    "probe-path-relative": "service:\n  readiness_probe: health\n" + _HTTP,
    "probe-post-data-string": "service:\n  readiness_probe:\n    path: /\n"
    "    post_data: '{\"model\": \"x\"}'\n" + _HTTP,
    "probe-header-number": "service:\n  readiness_probe:\n    path: /\n    headers: {X-N: 1}\n"
    + _HTTP,
    "qps-zero": "service:\n  readiness_probe: /\n  replica_policy:\n    min_replicas: 1\n"
    "    max_replicas: 2\n    target_qps_per_replica: 0\n" + _HTTP,
    "replicas-zero": "service:\n  readiness_probe: /\n  replicas: 0\n" + _HTTP,
    "replicas-negative": "service:\n  readiness_probe: /\n  replicas: -1\n" + _HTTP,
    "min-zero-no-max": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 0\n" + _HTTP,
    "overprovision": "service:\n  readiness_probe: /\n  replica_policy:\n    min_replicas: 1\n"
    "    max_replicas: 3\n    target_qps_per_replica: 1\n    num_overprovision: 1\n" + _HTTP,
    "upscale-negative": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    max_replicas: 3\n    target_qps_per_replica: 1\n"
    "    upscale_delay_seconds: -5\n" + _HTTP,
    "spot-placer-without-spot": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 1\n    spot_placer: dynamic_fallback\n" + _HTTP,
    "base-fallback-spot": "service:\n  readiness_probe: /\n  replica_policy:\n"
    "    min_replicas: 2\n    base_ondemand_fallback_replicas: 1\nresources:\n  ports: 8080\n"
    "  use_spot: true\nrun: serve\n",
    "port-as-string": "service:\n  readiness_probe: /\nresources:\n  ports: '8080'\nrun: serve\n",
    "service-port-string": "service:\n  readiness_probe: /\n  ports: '8081'\nresources:\n"
    "  ports: [8080, 8081]\nrun: serve\n",
    "service-port-not-opened": "service:\n  readiness_probe: /\n  ports: 9000\nresources:\n"
    "  ports: 8080\nrun: serve\n",
    "service-port-only": "service:\n  readiness_probe: /\n  ports: 8080\nrun: serve\n",
    "port-zero": "service:\n  readiness_probe: /\nresources:\n  ports: 0\nrun: serve\n",
    "tls-no-certfile": "service:\n  readiness_probe: /\n  tls:\n    keyfile: k.pem\n" + _HTTP,
    "env-bool": "envs:\n  DEBUG: true\nservice:\n  readiness_probe: /\n" + _HTTP,
    "env-bad-name": "envs:\n  1BAD: x\nservice:\n  readiness_probe: /\n" + _HTTP,
    "service-not-mapping": "service: yes\n" + _HTTP,
    "stream-timeout-zero": "service:\n  readiness_probe: /\n  load_balancer:\n"
    "    stream_timeout_seconds: 0\n" + _HTTP,
}

# Where sluice differs from SkyPilot on purpose: label -> why.
DELIBERATE: dict[str, str] = {
    "tests_skyserve_llm_service.yaml": "a secret without a value: SkyPilot's client accepts "
    "it and the replica gets no token; sluice refuses it, naming --secret",
    "llm_llama-3_1_llama-3_1.yaml": "a secret without a value (as above)",
    "probe-negative-delay": "a negative initial_delay_seconds: SkyPilot's schema has no "
    "minimum; sluice refuses a delay below 0 (it means nothing)",
    "upscale-negative": "a negative delay (as above)",
    "replicas-negative": "replicas: -1: SkyPilot's schema has no minimum; sluice refuses it",
    "probe-timeout-zero": "a probe timeout of 0 fails every probe; sluice refuses it",
    "stream-timeout-zero": "a stream timeout of 0 cuts every stream; sluice refuses it",
    "qps-zero": "target_qps_per_replica: 0 makes the autoscaler divide by zero",
    "env-bool": "an env `true`: SkyPilot passes Python's 'True'; sluice asks to quote it",
    "service-port-only": "service.ports without resources.ports: SkyPilot asks for both; "
    "sluice opens the service port itself (the skypilot backend adds it to the task)",
}

# What a local replica cannot be, as the local backend's error names it.
LOCAL_LIMITS = ("num_nodes:", "service.ports:")


@cache
def _python() -> Path:
    return Path(os.environ.get("SLUICE_SKYPILOT_PYTHON", REPO / ".venv-sky" / "bin" / "python"))


pytestmark = pytest.mark.skipif(
    not _python().exists(), reason=f"no SkyPilot venv at {_python()} (see .ci/run sky_venv)"
)


def _cases() -> dict[str, dict[str, object]]:
    cases: dict[str, dict[str, object]] = {}
    for path in REAL:
        cases[path.name] = {"file": path.name, "text": path.read_text(), "envs": {},
                            "secrets": {}}  # fmt: skip
        if path.name in OVERRIDES:
            envs, secrets = OVERRIDES[path.name]
            cases[f"{path.name} with overrides"] = {"file": path.name, "text": path.read_text(),
                                                    "envs": envs, "secrets": secrets}  # fmt: skip
    for label, text in SYNTHETIC.items():
        yaml.safe_load(text)  # each is YAML
        cases[label] = {"file": f"{label}.yaml", "text": text, "envs": {}, "secrets": {}}
    return cases


@cache
def _sky_judgement(tmp: Path) -> dict[str, Any]:
    out = tmp / "verdicts.json"
    proc = subprocess.run(
        [str(_python()), str(JUDGE), str(out)],
        input=json.dumps(_cases()),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    judgement: dict[str, Any] = json.loads(out.read_text())
    return judgement


def _sluice_verdict(case: dict[str, object], backend: str) -> str | None:
    envs, secrets = case["envs"], case["secrets"]
    assert isinstance(envs, dict) and isinstance(secrets, dict)
    try:
        spec = load_spec(str(case["text"]), envs=envs, secrets=secrets)
        check_backend(spec, backend)
    except (SpecError, BackendError) as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def judgement(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _sky_judgement(tmp_path_factory.mktemp("sky"))


@pytest.fixture(scope="module")
def verdicts(judgement: dict[str, Any]) -> dict[str, str | None]:
    found: dict[str, str | None] = judgement["verdicts"]
    return found


def _meaning(spec: ServiceSpec) -> dict[str, Any]:
    """What sluice made of a spec, in the judge's terms (skyserve_judge._meaning)."""
    scaling, probe = spec.service.scaling, spec.probe
    post = probe.post_data
    choices = [*(spec.resources.any_of or ()), *(spec.resources.ordered or ())] or [{}]
    return {
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "num_overprovision": scaling.num_overprovision,
        "target_qps_per_replica": scaling.target_qps_per_replica,
        "upscale_delay_seconds": scaling.upscale_delay_seconds,
        "downscale_delay_seconds": scaling.downscale_delay_seconds,
        "base_ondemand_fallback_replicas": scaling.base_ondemand_fallback_replicas,
        "dynamic_ondemand_fallback": scaling.dynamic_ondemand_fallback,
        "readiness_path": probe.path,
        "initial_delay_seconds": probe.initial_delay_seconds,
        "readiness_timeout_seconds": probe.timeout_seconds,
        "endpoint_probe_interval_seconds": probe.endpoint_probe_interval_seconds,
        "post_data": json.loads(post) if isinstance(post, str) else post,
        "readiness_headers": dict(probe.headers),
        "lb_stream_timeout_seconds": spec.service.load_balancer.stream_timeout_seconds,
        "load_balancing_policy": spec.service.load_balancing_policy,
        "port": spec.replica_port,
        "num_nodes": spec.num_nodes,
        "envs": dict(spec.envs),
        "secrets": dict(spec.secrets),
        "use_spot": sorted({bool(c.get("use_spot", spec.resources.use_spot)) for c in choices}),
        "run": spec.run,
    }


def test_what_both_accept_means_the_same(judgement: dict[str, Any]) -> None:
    """Each field sluice reads, for every spec both accept: the same value as SkyPilot's
    (the replica counts, delays, probe, policy, port, nodes, envs, secrets, spot, run)."""
    differences = []
    for label, sky in judgement["meanings"].items():
        case = _cases()[label]
        envs, secrets = case["envs"], case["secrets"]
        assert isinstance(envs, dict) and isinstance(secrets, dict)
        try:
            ours = _meaning(load_spec(str(case["text"]), envs=envs, secrets=secrets))
        except SpecError:
            continue  # a deliberate difference (test_skypilot_backend_agrees...)
        for field, value in sky.items():
            if json.loads(json.dumps(ours[field])) != value:
                differences.append(f"{label}: {field}: SkyPilot {value!r}, sluice "
                                   f"{ours[field]!r}")  # fmt: skip
    assert not differences, "\n".join(differences)


def test_the_corpus_holds_real_files_and_both_verdicts() -> None:
    cases = _cases()
    assert len(REAL) >= 30
    assert len(cases) >= len(REAL) + len(SYNTHETIC)
    assert set(DELIBERATE) <= set(cases)


@pytest.mark.parametrize("label", sorted(_cases()))
def test_skypilot_backend_agrees_with_skypilot(
    label: str, verdicts: dict[str, str | None]
) -> None:
    sky = verdicts[label]
    ours = _sluice_verdict(_cases()[label], "skypilot")
    if label in DELIBERATE:
        assert (sky is None) != (ours is None), f"{label} agrees now: drop it from DELIBERATE"
        return
    assert (ours is None) == (sky is None), f"{label}: SkyPilot {sky!r}, sluice {ours!r}"
    if ours is not None:
        assert "\n" not in ours.strip()


@pytest.mark.parametrize("label", sorted(_cases()))
def test_local_backend_differs_only_where_a_process_must(
    label: str, verdicts: dict[str, str | None]
) -> None:
    case = _cases()[label]
    sky, ours = verdicts[label], _sluice_verdict(case, "local")
    skypilot_ours = _sluice_verdict(case, "skypilot")
    if ours is not None and skypilot_ours is None:
        # Refused for the local backend only: one line naming the field and the backend
        # that can run it.
        assert ours.startswith(LOCAL_LIMITS), ours
        assert "--backend skypilot" in ours, ours
    elif ours is None and skypilot_ours is not None:
        assert "resources.ports" in skypilot_ours  # no port: the local backend picks one
    else:
        assert ours == skypilot_ours
    if label not in DELIBERATE and ours is None:
        assert sky is None or "port" in sky, f"{label}: SkyPilot {sky!r}"


def test_verdict_counts(
    verdicts: dict[str, str | None], capsys: pytest.CaptureFixture[str]
) -> None:
    """The count the closing note quotes (printed); every non-deliberate one agrees."""
    cases = _cases()
    agree = sum(
        (verdicts[label] is None) == (_sluice_verdict(case, "skypilot") is None)
        for label, case in cases.items()
    )
    real = sum(1 for label in cases if label.endswith(".yaml") or " with " in label)
    with capsys.disabled():
        print(f"\nskyserve corpus: {len(REAL)} real files ({real} cases with overrides), "
              f"{len(SYNTHETIC)} synthetic; {agree}/{len(cases)} verdicts agree with "
              f"SkyPilot 0.14.1, {len(DELIBERATE)} deliberate differences")  # fmt: skip
    assert agree == len(cases) - len(DELIBERATE)
