"""The CLI around the SkyPilot backend, in this venv (where SkyPilot is NOT installed:
it cannot share the lock): one clear error, the INFRA/RESOURCES columns, and
`sluice logs --replica` of a SkyPilot replica."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from controlplane.records import ReplicaRecord
from controlplane.states import ReplicaStatus
from tests.support.cli import one_line_error, sluice, store_call
from tests.support.processes import REPO

ECHO = REPO / "examples" / "echo.yaml"

needs_no_skypilot = pytest.mark.skipif(
    importlib.util.find_spec("sky") is not None, reason="SkyPilot is installed in this venv"
)


@pytest.fixture
def ops_args(redis_url: str, redis_prefix: str, tmp_path: Path) -> list[str]:
    return ["--redis", redis_url, "--prefix", redis_prefix, "--state-dir", str(tmp_path / "st")]


@needs_no_skypilot
@pytest.mark.parametrize("command", [["controller"], ["run", str(ECHO)]])
def test_backend_skypilot_without_skypilot_is_one_clear_error(
    command: list[str], tmp_path: Path
) -> None:
    line = one_line_error(
        sluice(*command, "--backend", "skypilot", "--state-dir", str(tmp_path / "st"))
    )
    assert "--backend skypilot" in line and "pip install 'sluice[skypilot]'" in line


def test_backend_choice_is_checked() -> None:
    result = sluice("controller", "--backend", "kubernetes")
    assert result.exit_code == 2
    assert "'kubernetes' is not one of 'local', 'skypilot'" in result.output


def _add_skypilot_replica(url: str, prefix: str) -> None:
    record = ReplicaRecord(
        id=1, status=ReplicaStatus.READY, backend="skypilot", spot=True,
        url="http://10.0.0.5:8080",
        handle={"cluster": "sluice-echo-r1-v1", "cloud": "AWS", "region": "us-east-1",
                "zone": "us-east-1a", "instance_type": "g6.xlarge",
                "accelerators": "L4:1", "spot": True, "price": 0.39},
    )  # fmt: skip
    store_call(url, prefix, lambda store: store.commit("echo", replica_updates=[record]))


def test_status_shows_where_a_skypilot_replica_runs(
    ops_args: list[str], redis_url: str, redis_prefix: str
) -> None:
    assert sluice("up", str(ECHO), "-n", "echo", *ops_args).exit_code == 0
    _add_skypilot_replica(redis_url, redis_prefix)
    out = sluice("status", "echo", *ops_args).stdout
    header = next(line for line in out.splitlines() if line.startswith("SERVICE_NAME"))
    assert header.split() == ["SERVICE_NAME", "ID", "VERSION", "ENDPOINT", "LAUNCHED", "INFRA",
                              "RESOURCES", "STATUS"]  # fmt: skip
    assert "AWS (us-east-1, us-east-1a)" in out
    assert "1x[Spot](g6.xlarge, L4:1) $0.39/h" in out


@needs_no_skypilot
def test_logs_of_a_skypilot_replica_need_skypilot(
    ops_args: list[str], redis_url: str, redis_prefix: str
) -> None:
    assert sluice("up", str(ECHO), "-n", "echo", *ops_args).exit_code == 0
    _add_skypilot_replica(redis_url, redis_prefix)
    line = one_line_error(sluice("logs", "echo", "--replica", "1", *ops_args))
    assert "pip install 'sluice[skypilot]'" in line
