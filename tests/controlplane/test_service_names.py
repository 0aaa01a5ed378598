"""Service names follow Sky Serve's rule (lowercase letters, digits, '-', starting with a
letter, not ending with '-'), at most 63 characters, checked at every entry: the CLI
(up, run, logs), the ops API, and the local backend (a name written into Redis by hand
must not become a path outside the state dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from controlplane import ops
from controlplane.backends.base import LaunchFailed
from controlplane.backends.local import LocalBackend
from controlplane.cli import cli
from controlplane.records import InvalidServiceName, check_service_name
from controlplane.servicespec import load_spec, parse_spec
from controlplane.store import Store
from tests.support.cli import redis_keys
from tests.support.processes import REPO

ECHO = REPO / "examples" / "echo.yaml"

BAD = ["../evil", "a/b", "..", "Echo", "my_svc", "a.b", "-x", "x-", "1abc", "a" * 64, "a b",
       "a:b", "é"]  # fmt: skip
GOOD = ["a", "echo", "llm-70b", "v2", "a" * 63]


@pytest.mark.parametrize("name", BAD)
def test_check_service_name_refuses(name: str) -> None:
    with pytest.raises(InvalidServiceName, match="invalid service name"):
        check_service_name(name)


@pytest.mark.parametrize("name", GOOD)
def test_check_service_name_accepts(name: str) -> None:
    assert check_service_name(name) == name


@pytest.mark.parametrize("name", BAD)
def test_cli_up_refuses_a_bad_name_before_redis(
    name: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    argv = ["up", str(ECHO), "-n", name, "--redis", redis_url, "--prefix", redis_prefix,
            "--state-dir", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    assert "invalid service name" in result.stderr
    assert "lowercase letters, digits and '-'" in result.stderr
    assert redis_keys(redis_url, redis_prefix) == []


@pytest.mark.parametrize("name", ["../evil", "a/b", "Echo"])
def test_cli_run_refuses_a_bad_name_before_starting_anything(name: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = CliRunner().invoke(cli, ["run", str(ECHO), "-n", name, "--state-dir", str(state)])
    assert result.exit_code == 2, result.output
    assert "invalid service name" in result.stderr
    assert not state.exists()


def test_cli_run_makes_the_yaml_name_valid(tmp_path: Path) -> None:
    """A YAML `name` is not a path: `../../escape` becomes the service `escape` (as a
    file name does), said so; -n is the name to give exactly."""
    spec = tmp_path / "svc.yaml"
    spec.write_text(ECHO.read_text().replace("name: echo", "name: ../../escape"))
    state = tmp_path / "s"
    result = CliRunner().invoke(cli, ["run", str(spec), "--state-dir", str(state), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "service name: escape (from the YAML's `name` '../../escape'" in result.output
    assert not state.exists()


def test_cli_logs_refuses_a_path_as_a_name(tmp_path: Path) -> None:
    (tmp_path / "proxy.log").write_text("outside the service directory")
    state = tmp_path / "state"
    state.mkdir()
    result = CliRunner().invoke(cli, ["logs", "..", "--proxy", "--state-dir", str(state)])
    assert result.exit_code == 2, result.output
    assert "outside" not in result.output


@pytest.mark.parametrize("name", ["../evil", "a/b", "Echo"])
async def test_ops_up_refuses_a_bad_name(
    name: str, store: Store, redis_url: str, redis_prefix: str
) -> None:
    with pytest.raises(InvalidServiceName):
        await ops.up(store, name, load_spec(ECHO))
    assert redis_keys(redis_url, redis_prefix) == []


async def test_ops_up_accepts_the_longest_name(store: Store) -> None:
    record = await ops.up(store, "a" * 63, load_spec(ECHO))
    assert record.name == "a" * 63


async def test_local_backend_never_makes_a_path_of_a_bad_name(tmp_path: Path) -> None:
    # As if someone wrote `../escape` into the services set by hand.
    state = tmp_path / "state"
    backend = LocalBackend(state, term_timeout=1)
    spec = parse_spec({"service": {"readiness_probe": "/", "replicas": 1}, "run": "sleep 30"})
    with pytest.raises(LaunchFailed, match="invalid service name"):
        await backend.launch("../escape", 1, 1, spec)
    assert not (tmp_path / "escape").exists()
    assert backend.recover("../escape", 1) is None
