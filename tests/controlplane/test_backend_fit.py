"""What each backend can run (`backends.fit`) and the SkyPilot rules the spec follows, on
their own (test_skyserve_corpus.py checks the same against SkyPilot itself, when its venv
is there); and the line `sluice run` prints for a replica that failed."""

from __future__ import annotations

import io

import pytest

from controlplane.backends.fit import Unfit, check_backend, check_run_command
from controlplane.backends.fixedport import PortConflict
from controlplane.display import LiveView
from controlplane.ops import ReplicaStatusView, ServiceView
from controlplane.rollout import accelerator_of
from controlplane.servicespec import SpecError, load_spec

BASE = "service:\n  readiness_probe: /\n  replicas: {replicas}\n"


def spec(extra: str, replicas: int = 1, run: str | None = "serve --port $PORT") -> str:
    text = BASE.format(replicas=replicas) + extra
    return text + (f"run: {run}\n" if run is not None else "")


def test_accelerator_names_with_null_counts_are_accepted() -> None:
    loaded = load_spec(spec("resources:\n  accelerators: {L4:1, A10G:1}\n"))
    assert loaded.resources.accelerators == {"L4:1": None, "A10G:1": None}
    assert accelerator_of(loaded) == "L4:1"
    assert accelerator_of(load_spec(spec("resources:\n  accelerators: {A100: 8}\n"))) == "A100:8"


def test_multi_node_is_for_the_skypilot_backend() -> None:
    loaded = load_spec(spec("num_nodes: 2\nresources:\n  ports: 8080\n"))
    with pytest.raises(Unfit, match=r"^num_nodes: 2 nodes per replica.*--backend skypilot"):
        check_backend(loaded, "local")
    check_backend(loaded, "skypilot")
    with pytest.raises(SpecError, match=r"\$\.num_nodes"):
        load_spec(spec("num_nodes: 0\n"))


def test_a_fixed_port_with_two_replicas_is_for_the_skypilot_backend() -> None:
    loaded = load_spec(spec("resources:\n  ports: 8081\n", replicas=2, run="serve --port 8081"))
    with pytest.raises(PortConflict, match=r"^service.ports: .*--backend skypilot"):
        check_backend(loaded, "local")
    check_backend(loaded, "skypilot")


def test_the_skypilot_backend_needs_a_port_the_local_one_picks_one() -> None:
    loaded = load_spec(spec(""))
    check_backend(loaded, "local")
    with pytest.raises(Unfit, match=r"^resources.ports: the skypilot backend needs"):
        check_backend(loaded, "skypilot")


def test_no_run_is_refused_only_where_replicas_would_be_launched_locally() -> None:
    loaded = load_spec(spec("resources:\n  ports: 8080\n", run=None))
    check_backend(loaded, "local")  # sluice up: replicas may come from `replica add`
    with pytest.raises(Unfit, match=r"^run: the local backend"):
        check_run_command(loaded, "local")
    check_run_command(loaded, "skypilot")
    check_run_command(load_spec(spec("", replicas=0, run=None)), "local")


@pytest.mark.parametrize(
    ("extra", "path", "needle"),
    [
        ("resources:\n  job_recovery: EAGER_NEXT_REGION\n", "$.resources.job_recovery",
         "not for services"),
        ("resources:\n  any_of:\n    - use_spot: true\n    - use_spot: false\n",
         "$.resources.any_of", "every choice must use spot or none"),
        ("resources:\n  use_spot: true\n  ordered:\n    - cloud: aws\n    - cloud: gcp\n"
         "      use_spot: false\n", "$.resources.any_of", "spot or none"),
        ("resources:\n  ordered:\n    - job_recovery: FAILOVER\n", "$.resources.job_recovery",
         "not for services"),
    ],
)  # fmt: skip
def test_sky_serve_resource_rules(extra: str, path: str, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(spec(extra))
    assert info.value.path == path and needle in info.value.reason


@pytest.mark.parametrize(("key", "flag"), [("envs", "--env"), ("secrets", "--secret")])
def test_a_value_left_empty_names_the_flags_that_fill_it(key: str, flag: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(f"{key}:\n  HF_TOKEN:\n" + spec(""))
    assert info.value.path == f"$.{key}.HF_TOKEN"
    assert f"{flag} HF_TOKEN=VALUE" in info.value.reason and f"{flag}-file" in info.value.reason
    filled = {"HF_TOKEN": "x"}
    loaded = load_spec(f"{key}:\n  HF_TOKEN:\n" + spec(""), **{key: filled})
    assert getattr(loaded, key) == filled


# -- what `sluice run` prints of a replica (display.LiveView) ---------------------------------


def _view(reason: str | None, status: str = "FAILED") -> ServiceView:
    replica = ReplicaStatusView(id=2, version=1, url="http://127.0.0.1:4100", status=status,
                          backend="local", launched_at=None, first_ready_at=None,
                          reason=reason, log="/s/echo/replica-2.log")  # fmt: skip
    return ServiceView(name="echo", status="FAILED", version=1, active_versions=[],
                       update_mode="rolling", policy="least_load", endpoint=None,
                       created_at=0.0, uptime=0.0, ready=0, total=0, generation=1,
                       replicas=[replica])  # fmt: skip


@pytest.mark.parametrize("tty", [False, True])
def test_a_failed_replica_line_has_its_own_reason_and_log(tty: bool) -> None:
    out = io.StringIO()
    LiveView(out, tty=tty).update(_view("replica 2 (v1): process exited with code 3"), 0.0)
    assert "replica 2 (version 1, http://127.0.0.1:4100): FAILED: process exited with code " \
           "3 (log: /s/echo/replica-2.log)" in out.getvalue()
    # Another replica's reason is never shown as this one's own (the prefix stays).
    out = io.StringIO()
    LiveView(out, tty=tty).update(_view("replica 1 (v1): process exited with code 4"), 0.0)
    assert "FAILED: replica 1 (v1): process exited with code 4" in out.getvalue()


def test_a_ready_replica_line_has_no_reason() -> None:
    out = io.StringIO()
    LiveView(out, tty=False).update(_view("replica 2 (v1): was not ready", "READY"), 0.0)
    assert out.getvalue().rstrip().endswith("replica 2 (version 1, http://127.0.0.1:4100): READY")
