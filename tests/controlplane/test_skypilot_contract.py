"""Contract tests against the REAL SkyPilot package (0.14.x), installed in its own venv.

SkyPilot pins click<8.2 and cannot share the project's lock, so it lives in
`.venv-sky` (`python3 -m venv .venv-sky && .venv-sky/bin/pip install skypilot==0.14.1`;
override the interpreter with SLUICE_SKYPILOT_PYTHON). These tests build, in this
venv, the tasks the backend would launch for every example YAML, and ask that
interpreter (tests/controlplane/skypilot_contract.py) whether SkyPilot accepts them
(`sky.Task.from_yaml_config`: its schema and resource parsing), whether the cluster
names pass `check_cluster_name_is_valid`, and whether every SDK function and
keyword the adapter uses exists with that name in the installed SDK. Skipped, with
the reason, when the venv is missing. Catalog checks (does AWS sell an L4 in that
region?) need the network and are not made here.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from controlplane.backends.skypilot_sdk import RESOURCES_ATTRS, SDK_CALLS, STATUS_FIELDS
from controlplane.backends.skypilot_task import cluster_name, task_config
from controlplane.servicespec import load_spec
from tests.support.processes import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SCRIPT = Path(__file__).with_name("skypilot_contract.py")


def _python() -> Path:
    return Path(os.environ.get("SLUICE_SKYPILOT_PYTHON", REPO / ".venv-sky" / "bin" / "python"))


pytestmark = pytest.mark.skipif(
    not _python().exists(),
    reason=f"no SkyPilot venv at {_python()} (python3 -m venv .venv-sky && "
    ".venv-sky/bin/pip install skypilot==0.14.1)",
)


def _tasks() -> dict[str, dict[str, Any]]:
    tasks: dict[str, dict[str, Any]] = {}
    for path in EXAMPLES:
        spec = load_spec(path)
        port = spec.replica_port
        assert port is not None, f"{path.name}: the skypilot backend needs a port"
        tasks[path.name] = task_config(spec, replica_id=1, port=port, base_dir=REPO)
        if spec.resources.use_spot:
            tasks[f"{path.name} on-demand"] = task_config(
                spec, replica_id=2, port=port, base_dir=REPO, on_demand=True
            )
            tasks[f"{path.name} after a preemption"] = task_config(
                spec, replica_id=3, port=port, base_dir=REPO, avoid={("aws",)}
            )
    return tasks


NAMES = [
    cluster_name("sluice", "echo", 1, 1),
    cluster_name("sluice", "My_Service.v2", 123, 45),
    cluster_name("sluice", "9lives", 1, 1),
    cluster_name("my:prefix", "x" * 90, 99999, 12),
]


@cache
def _ask() -> dict[str, Any]:
    request = {
        "tasks": _tasks(),
        "cluster_names": NAMES,
        "calls": {k: list(v) for k, v in SDK_CALLS.items()},
        "status_fields": list(STATUS_FIELDS),
        "resources_attrs": list(RESOURCES_ATTRS),
    }
    home = REPO / ".venv-sky" / "home"  # SkyPilot writes ~/.sky: keep it out of the real home
    home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [str(_python()), str(SCRIPT)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


def test_the_installed_skypilot_is_0_14() -> None:
    assert _ask()["version"].startswith("0.14."), _ask()["version"]


@pytest.mark.parametrize("label", sorted(_tasks()))
def test_every_example_task_is_accepted_by_skypilot(label: str) -> None:
    answer = _ask()["tasks"][label]
    assert answer["error"] is None, answer["error"]
    assert answer["resources"], "SkyPilot built no resources"
    task = _tasks()[label]
    spot = task["resources"].get("use_spot", False)
    for resources in answer["resources"]:
        assert resources["use_spot"] is spot
        assert any(str(task["envs"]["PORT"]) in p for p in resources["ports"])
    assert answer["envs"]["SKYPILOT_SERVE_REPLICA_ID"] == task["envs"]["SKYPILOT_SERVE_REPLICA_ID"]


def test_the_gpu_example_asks_for_one_l4_or_a10g_on_spot_with_on_demand_fallback() -> None:
    answers = _ask()["tasks"]
    spot = answers["vllm_gpu.yaml"]["resources"]
    assert {frozenset(r["accelerators"].items()) for r in spot} >= {
        frozenset({("L4", 1)}), frozenset({("A10G", 1)}),
    }  # fmt: skip
    assert all(r["use_spot"] for r in spot)
    assert not any(r["use_spot"] for r in answers["vllm_gpu.yaml on-demand"]["resources"])
    # After a preemption on AWS, the next spot launch goes to GCP.
    avoided = _tasks()["vllm_gpu.yaml after a preemption"]["resources"]["any_of"]
    assert [e["infra"] for e in avoided] == ["gcp"]
    clouds = {r["cloud"] for r in answers["vllm_gpu.yaml after a preemption"]["resources"]}
    assert clouds == {"GCP"}


@pytest.mark.parametrize("name", NAMES)
def test_cluster_names_pass_skypilots_check(name: str) -> None:
    assert _ask()["cluster_names"][name] is None


@pytest.mark.parametrize("call", sorted(SDK_CALLS))
def test_the_adapters_sdk_calls_exist_with_their_keywords(call: str) -> None:
    assert _ask()["calls"][call] == {"missing": [], "error": None}


def test_status_fields_and_resource_attributes_the_adapter_reads_exist() -> None:
    answer = _ask()
    assert answer["status_fields_missing"] == []
    assert answer["resources_attrs_missing"] == []
    extra = [k for k in answer["calls"] if k not in SDK_CALLS]
    assert extra and all(answer["calls"][k]["missing"] == [] for k in extra)
