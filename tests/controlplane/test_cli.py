"""The `sluice` CLI: parsing and one-line errors with click's CliRunner, the ops commands
against the real redis-server fixture, and `sluice run` / `sluice snapshot --watch` as
real processes stopped with SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner

from controlplane.cli import cli
from controlplane.display import duration
from controlplane.records import ReplicaRecord
from controlplane.states import ReplicaStatus
from controlplane.store import Store, StoreUnavailable
from proxy.wire.snapshot import ReadySnapshot
from tests.support.cli import (
    one_line_error,
    redis_keys,
    sluice,
    sluice_child,
    store_call,
    wait_exit,
)
from tests.support.pids import descendants, kill_all, running
from tests.support.poll import until, until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, http_get

ECHO = REPO / "examples" / "echo.yaml"


# -- helpers ---------------------------------------------------------------------------------


def dead_redis_url() -> str:
    return f"redis://{HOST}:{free_port()}/0"


@pytest.fixture
def ops_args(redis_url: str, redis_prefix: str, tmp_path: Path) -> list[str]:
    """--redis, --prefix and a private --state-dir (so no run.json of a real run leaks in)."""
    return ["--redis", redis_url, "--prefix", redis_prefix, "--state-dir", str(tmp_path / "st")]


@pytest.fixture
def echo_up(ops_args: list[str]) -> list[str]:
    """Service `echo` registered from examples/echo.yaml (no controller runs)."""
    result = sluice("up", str(ECHO), "-n", "echo", "--endpoint", "http://127.0.0.1:8080",
                    *ops_args)  # fmt: skip
    assert result.exit_code == 0, result.output
    return ops_args


def commit_ready(url: str, prefix: str, name: str, replica_id: int, port: int) -> None:
    """Mark a replica READY at 127.0.0.1:port, as the controller would (one commit)."""

    record = ReplicaRecord(
        id=replica_id,
        status=ReplicaStatus.READY,
        url=f"http://{HOST}:{port}",
        backend="external",
        launched_at=time.time(),
        first_ready_at=time.time(),
    )
    store_call(url, prefix, lambda store: store.commit(name, replica_updates=[record]))


# -- parsing and errors ----------------------------------------------------------------------


BAD_SPECS = {
    "readiness": ("service:\n  readiness_probe: health\n  replicas: 1\nrun: x\n",
                  "$.service.readiness_probe"),
    "replicas": ("service:\n  readiness_probe: /\n  replicas: -1\nrun: x\n",
                 "$.service.replicas"),
    "policy": ("service:\n  replica_policy:\n    min_replicas: 2\n    max_replicas: 1\n"
               "run: x\n", "$.service.replica_policy.max_replicas"),
    "unknown": ("service:\n  replicas: 1\n  replicaz: 2\nrun: x\n", "$.service.replicaz"),
    "yaml": ("service: [\n", "$"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_invalid_spec_is_one_line_and_never_reaches_redis(
    case: str, tmp_path: Path, redis_url: str, redis_prefix: str, ops_args: list[str]
) -> None:
    text, field = BAD_SPECS[case]
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    line = one_line_error(sluice("up", str(bad), "-n", "svc", *ops_args), field)
    assert str(bad) in line
    assert redis_keys(redis_url, redis_prefix) == []
    # update and run load the spec before anything else too.
    one_line_error(sluice("update", "svc", str(bad), *ops_args), field)
    state = tmp_path / "run-state"
    result = sluice("run", str(bad), "--redis", redis_url, "--prefix", redis_prefix,
                    "--state-dir", str(state))  # fmt: skip
    one_line_error(result, field)
    assert redis_keys(redis_url, redis_prefix) == []
    assert not (state / "run.json").exists()


def test_missing_file(tmp_path: Path, ops_args: list[str]) -> None:
    one_line_error(sluice("up", str(tmp_path / "nope.yaml"), *ops_args),
                          "nope.yaml", "cannot read")  # fmt: skip


def test_invalid_service_name_is_a_usage_error(ops_args: list[str]) -> None:
    result = sluice("up", str(ECHO), "-n", "a:b", *ops_args)
    assert result.exit_code == 2
    assert "service name" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["status", "ghost"],
        ["down", "ghost"],
        ["update", "ghost", str(ECHO)],
        ["snapshot", "ghost"],
        ["snapshot", "ghost", "--watch"],
        ["replica", "add", "ghost", "http://127.0.0.1:9"],
        ["replica", "remove", "ghost", "http://127.0.0.1:9"],
        ["logs", "ghost", "--replica", "1"],
    ],
)
def test_unknown_service(args: list[str], ops_args: list[str]) -> None:
    one_line_error(sluice(*args, *ops_args), "no service 'ghost'")


@pytest.mark.parametrize(
    "args", [["status"], ["down", "x"], ["snapshot", "x"], ["up", str(ECHO)], ["run", str(ECHO)]]
)
def test_unreachable_redis_names_the_url(args: list[str], tmp_path: Path) -> None:
    url = dead_redis_url()
    result = sluice(*args, "--redis", url, "--state-dir", str(tmp_path))
    one_line_error(result, f"cannot reach Redis at {url}")


def test_unreachable_redis_hides_the_password(tmp_path: Path) -> None:
    port = free_port()
    result = sluice("status", "--redis", f"redis://:s3cret@{HOST}:{port}/0",
                    "--state-dir", str(tmp_path))  # fmt: skip
    line = one_line_error(result, "cannot reach Redis at redis://:***@")
    assert "s3cret" not in result.output and "s3cret" not in line


def test_bad_redis_url(tmp_path: Path) -> None:
    result = sluice("status", "--redis", "localhost:6379", "--state-dir", str(tmp_path))
    one_line_error(result, "redis")


def test_redis_url_from_environment(echo_up: list[str], redis_url: str, redis_prefix: str,
                                    tmp_path: Path) -> None:  # fmt: skip
    env = {"SLUICE_REDIS_URL": redis_url, "SLUICE_PREFIX": redis_prefix}
    result = sluice("status", "echo", "--endpoint", "--state-dir", str(tmp_path), env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "http://127.0.0.1:8080"


def test_redis_url_from_a_running_sluice_run(
    echo_up: list[str], redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    # A live `sluice run` on the state dir (here: this process) tells where its Redis is.
    state = tmp_path / "st"
    state.mkdir(exist_ok=True)
    info = {"pid": os.getpid(), "service": "echo", "redis_url": redis_url,
            "prefix": redis_prefix, "endpoint": "http://x:1", "started_at": 0.0}  # fmt: skip
    (state / "run.json").write_text(json.dumps(info))
    result = sluice("status", "echo", "--endpoint", "--state-dir", str(state))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "http://127.0.0.1:8080"


def test_run_refuses_a_state_dir_in_use(tmp_path: Path) -> None:
    info = {"pid": os.getppid(), "service": "other", "redis_url": "redis://127.0.0.1:1/0",
            "prefix": "sluice", "endpoint": "http://x:1", "started_at": 0.0}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(info))
    result = sluice("run", str(ECHO), "--state-dir", str(tmp_path))
    one_line_error(result, "another `sluice run`", str(os.getppid()))
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_run_refuses_an_existing_service(
    echo_up: list[str], redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    state = tmp_path / "run-state"
    result = sluice("run", str(ECHO), "--redis", redis_url, "--prefix", redis_prefix,
                    "--state-dir", str(state))  # fmt: skip
    one_line_error(result, "service 'echo' already exists")
    assert not (state / "run.json").exists()
    assert not (state / "controller.log").exists()  # no process was started


def test_logs_without_a_source_and_without_logs_says_where_it_looked(tmp_path: Path) -> None:
    result = sluice("logs", "svc", "--state-dir", str(tmp_path))
    one_line_error(result, f"no logs of svc under {tmp_path}", "--controller")


def test_logs_without_a_source_prints_every_log_of_the_service(tmp_path: Path) -> None:
    (tmp_path / "svc").mkdir()
    for path, text in (("controller.log", "ctl\n"), ("svc/proxy.log", "lb\n"),
                       ("svc/replica-10.log", "r10\n"), ("svc/replica-2.log", "r2\n"),
                       ("other.log", "no\n")):  # fmt: skip
        (tmp_path / path).write_text(text)
    result = sluice("logs", "svc", "--no-follow", "--state-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    shown = [line for line in result.stdout.splitlines() if line and not line.startswith("==>")]
    assert shown == ["ctl", "lb", "r2", "r10"]


def test_status_endpoint_without_a_name_needs_exactly_one_service(ops_args: list[str]) -> None:
    # As `sky serve status --endpoint`: the only service's endpoint, else a usage error.
    result = sluice("status", "--endpoint", *ops_args)
    assert result.exit_code == 2 and "No services found" in result.stderr
    up = sluice("up", str(ECHO), "-n", "one", "--endpoint", "http://127.0.0.1:8080", *ops_args)
    assert up.exit_code == 0, up.output
    result = sluice("status", "--endpoint", *ops_args)
    assert result.exit_code == 0, result.output
    assert result.stdout == "http://127.0.0.1:8080\n"
    assert sluice("up", str(ECHO), "-n", "two", *ops_args).exit_code == 0
    result = sluice("status", "--endpoint", *ops_args)
    assert result.exit_code == 2 and "2 services found" in result.stderr


def test_proxy_is_sluice_proxy() -> None:
    from proxy.cli import proxy_command

    assert cli.commands["proxy"] is proxy_command
    result = sluice("proxy", "--help")
    assert result.exit_code == 0
    assert "--redis" in result.stdout and "--service" in result.stdout


def test_help_lists_every_command() -> None:
    result = sluice("--help")
    assert result.exit_code == 0
    for command in ("run", "up", "update", "down", "status", "logs", "replica", "snapshot",
                    "controller", "proxy"):  # fmt: skip
        assert command in result.stdout


# -- ops commands against Redis ----------------------------------------------------------------


def test_up_then_status(echo_up: list[str]) -> None:
    result = sluice("status", *echo_up)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "Services"
    assert lines[1].split() == ["NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT"]
    name, versions, *_, replicas, endpoint = lines[2].split()
    assert (name, versions, replicas, endpoint) == ("echo", "-", "0/0", "http://127.0.0.1:8080")
    assert "No replicas." in result.stdout

    result = sluice("status", "echo", "--json", *echo_up)
    assert result.exit_code == 0, result.output
    [view] = json.loads(result.stdout)
    assert view["name"] == "echo" and view["version"] == 1 and view["replicas"] == []

    one_line_error(sluice("up", str(ECHO), "-n", "echo", *echo_up), "already exists")


def test_up_names_the_service_after_the_yaml(ops_args: list[str]) -> None:
    result = sluice("up", str(ECHO), *ops_args)  # echo.yaml says `name: echo`
    assert result.exit_code == 0, result.output
    assert sluice("status", "echo", *ops_args).exit_code == 0


def test_update_and_down(echo_up: list[str]) -> None:
    result = sluice("update", "echo", str(ECHO), "--mode", "blue_green", *echo_up)
    assert result.exit_code == 0, result.output
    assert "version 2 (blue_green)" in result.stdout
    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    assert (view["version"], view["update_mode"]) == (2, "blue_green")

    assert sluice("update", "echo", str(ECHO), "--mode", "sideways", *echo_up).exit_code == 2

    result = sluice("down", "echo", "-y", *echo_up)
    assert result.exit_code == 0, result.output
    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    assert view["status"] == "SHUTTING_DOWN"
    one_line_error(sluice("update", "echo", str(ECHO), *echo_up), "shutting down")


def test_replica_add_and_remove(echo_up: list[str]) -> None:
    url = "http://127.0.0.1:9"
    result = sluice("replica", "add", "echo", url + "/", "--accelerator", "A100:1", "--spot",
                    *echo_up)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"replica 1 at {url} registered" in result.stdout

    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    [replica] = view["replicas"]
    assert replica["url"] == url and replica["backend"] == "external"
    assert replica["accelerator"] == "A100:1" and replica["spot"] is True
    table = sluice("status", "echo", *echo_up).stdout
    assert "Service Replicas" in table and url in table

    one_line_error(sluice("replica", "add", "echo", url, *echo_up), "already has replica")
    result = sluice("replica", "add", "echo", "ftp://127.0.0.1:9", *echo_up)
    assert result.exit_code == 2 and "http(s)" in result.stderr

    result = sluice("replica", "remove", "echo", url, *echo_up)
    assert result.exit_code == 0, result.output
    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    assert view["replicas"][0]["status"] == "SHUTTING_DOWN"
    one_line_error(sluice("replica", "remove", "echo", "http://127.0.0.1:10", *echo_up),
                          "no external replica")  # fmt: skip


def test_snapshot(echo_up: list[str], redis_url: str, redis_prefix: str) -> None:
    result = sluice("snapshot", "echo", *echo_up)
    assert result.exit_code == 0, result.output
    assert "service echo  generation 1" in result.stdout
    assert "No ready replicas." in result.stdout

    commit_ready(redis_url, redis_prefix, "echo", 7, 4321)
    result = sluice("snapshot", "echo", "--json", *echo_up)
    assert result.exit_code == 0, result.output
    snap = msgspec.json.decode(result.stdout, type=ReadySnapshot)
    assert snap.generation == 2 and snap.status == "CONTROLLER_INIT"
    assert snap.active_versions == [1]
    assert [(r.id, r.url) for r in snap.replicas] == [(7, f"http://{HOST}:4321")]
    text = sluice("snapshot", "echo", *echo_up).stdout
    assert "generation 2" in text and f"http://{HOST}:4321" in text and "policy least_load" in text


def test_logs(tmp_path: Path, echo_up: list[str], redis_url: str, redis_prefix: str) -> None:
    state = tmp_path / "st"
    (state / "echo").mkdir(parents=True)
    (state / "controller.log").write_text("controller line\n")
    (state / "echo" / "proxy.log").write_text("proxy line\n")
    (state / "echo" / "replica-2.log").write_text("replica two\n")
    elsewhere = tmp_path / "elsewhere.log"
    elsewhere.write_text("replica three\n")

    local = ReplicaRecord(id=3, status=ReplicaStatus.STARTING, backend="local",
                          handle={"pid": 1, "log": str(elsewhere)})  # fmt: skip
    store_call(redis_url, redis_prefix, lambda s: s.commit("echo", replica_updates=[local]))
    args = ["--no-follow", *echo_up]
    assert sluice("logs", "echo", "--controller", *args).stdout == "controller line\n"
    assert sluice("logs", "echo", "--proxy", *args).stdout == "proxy line\n"
    # The handle's log path when the record has one; the backend's default path otherwise.
    assert sluice("logs", "echo", "--replica", "3", *args).stdout == "replica three\n"
    assert sluice("logs", "echo", "--replica", "2", *args).stdout == "replica two\n"
    one_line_error(sluice("logs", "echo", "--replica", "9", *args), "no replica 9")
    one_line_error(sluice("logs", "other", "--proxy", *args), "no log at")

    # `sky serve logs` spellings: --load-balancer, replica IDs as arguments, --tail N.
    assert sluice("logs", "echo", "--load-balancer", *args).stdout == "proxy line\n"
    assert sluice("logs", "echo", "2", *args).stdout == "replica two\n"
    (state / "controller.log").write_text("".join(f"line {i}\n" for i in range(1, 6)))
    tail = sluice("logs", "echo", "--controller", "--tail", "2", *echo_up)  # no follow
    assert tail.exit_code == 0 and tail.stdout == "line 4\nline 5\n"
    assert sluice("logs", "echo", "--controller", "--tail", "0", *echo_up).stdout == ""
    assert sluice("logs", "echo", "--controller", "--tail", "9", *echo_up).stdout.count("line") == 5
    both = sluice("logs", "echo", "2", "3", *args).stdout
    assert both == (
        f"==> {state / 'echo' / 'replica-2.log'} <==\nreplica two\n"
        f"\n==> {elsewhere} <==\nreplica three\n"
    )
    assert sluice("logs", "echo", "--tail", "-1", "2", *args).exit_code == 2


def _spec_of(url: str, prefix: str, name: str, version: int = 1) -> dict[str, Any]:
    raw = store_call(url, prefix, lambda store: store.spec(name, version))
    assert raw is not None
    decoded: dict[str, Any] = json.loads(raw)
    return decoded


def _statuses(ops_args: list[str]) -> dict[str, str]:
    result = sluice("status", "--json", *ops_args)
    assert result.exit_code == 0, result.output
    return {v["name"]: v["status"] for v in json.loads(result.stdout)}


LLM_YAML = """\
service:
  readiness_probe:
    path: /v1/chat/completions
    post_data: {model: $MODEL_NAME, max_tokens: 1}
    headers: {Authorization: Bearer $API_KEY}
  replicas: 1
envs:
  MODEL_NAME: small
  HF_TOKEN:
run: serve --model $MODEL_NAME
"""


def test_up_env_and_secret_overrides_fill_the_yaml(
    tmp_path: Path, ops_args: list[str], redis_url: str, redis_prefix: str
) -> None:
    yaml_file = tmp_path / "llm.yaml"
    yaml_file.write_text(LLM_YAML)
    one_line_error(sluice("up", str(yaml_file), *ops_args), "$.envs.HF_TOKEN")
    env_file = tmp_path / "llm.env"
    env_file.write_text("MODEL_NAME=from-file\nHF_TOKEN=hf-file\n")
    secret_file = tmp_path / "llm.secrets"
    secret_file.write_text("API_KEY=sk-file\n")
    result = sluice(
        "up", str(yaml_file), "-n", "llm", "-y", "--env-file", str(env_file),
        "--env", "MODEL_NAME=Qwen/Qwen2.5-0.5B", "--env", "HF_TOKEN",
        "--secret-file", str(secret_file), "--secret", "API_KEY", *ops_args,
        env={"HF_TOKEN": "hf-shell", "API_KEY": "sk-shell"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    spec = _spec_of(redis_url, redis_prefix, "llm")
    probe = spec["service"]["readiness_probe"]
    assert probe["post_data"] == {"model": "Qwen/Qwen2.5-0.5B", "max_tokens": 1}
    assert probe["headers"] == {"Authorization": "Bearer sk-shell"}
    assert spec["envs"] == {"MODEL_NAME": "Qwen/Qwen2.5-0.5B", "HF_TOKEN": "hf-shell"}
    # SkyPilot 0.14.1 also loads --env-file into the secrets, where MODEL_NAME=from-file
    # would beat --env in $MODEL_NAME; here --env wins (docs/cli.md).
    assert spec["secrets"] == {"API_KEY": "sk-shell"}
    assert spec["run"] == "serve --model $MODEL_NAME"  # the shell expands it at run time

    unset = sluice("up", str(yaml_file), "-n", "x", "--env", "NOT_SET_ANYWHERE_42", *ops_args)
    assert unset.exit_code == 2 and "NOT_SET_ANYWHERE_42 is not set" in unset.stderr
    missing = sluice("up", str(yaml_file), "-n", "x", "--env-file", str(tmp_path / "no.env"),
                     *ops_args)  # fmt: skip
    assert missing.exit_code == 2 and "no.env" in missing.stderr
    # update takes them too.
    result = sluice("update", "llm", str(yaml_file), "--env", "HF_TOKEN=t", "-y", *ops_args)
    assert result.exit_code == 0, result.output
    assert _spec_of(redis_url, redis_prefix, "llm", 2)["service"]["readiness_probe"][
        "post_data"
    ] == {"model": "small", "max_tokens": 1}


def test_update_defaults_to_rolling_like_sky(echo_up: list[str]) -> None:
    assert sluice("update", "echo", str(ECHO), "--mode", "blue_green", *echo_up).exit_code == 0
    result = sluice("update", "echo", str(ECHO), *echo_up)
    assert result.exit_code == 0 and "version 3 (rolling)" in result.stdout, result.output
    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    assert view["update_mode"] == "rolling"


def test_down_several_names_globs_all_and_the_prompt(ops_args: list[str]) -> None:
    for name in ("echo-a", "echo-b", "other", "last"):
        assert sluice("up", str(ECHO), "-n", name, *ops_args).exit_code == 0

    assert sluice("down", *ops_args).exit_code == 2  # neither NAMEs nor --all
    assert sluice("down", "echo-a", "--all", *ops_args).exit_code == 2
    no = CliRunner().invoke(cli, ["down", "echo-*", *ops_args], input="n\n")
    assert no.exit_code == 1 and "Taking down service(s) 'echo-a', 'echo-b'. Proceed?" in (
        no.output
    )
    assert set(_statuses(ops_args).values()) == {"CONTROLLER_INIT"}  # nothing happened
    # A pattern that matches nothing fails before anything is taken down.
    one_line_error(sluice("down", "other", "nope-*", "-y", *ops_args),
                          "no service matches 'nope-*'")  # fmt: skip
    one_line_error(sluice("down", "ghost", "other", "-y", *ops_args),
                          "no service 'ghost'")  # fmt: skip
    assert _statuses(ops_args)["other"] == "CONTROLLER_INIT"

    yes = CliRunner().invoke(cli, ["down", "echo-*", "other", *ops_args], input="y\n")
    assert yes.exit_code == 0, yes.output
    assert _statuses(ops_args) == {"echo-a": "SHUTTING_DOWN", "echo-b": "SHUTTING_DOWN",
                                   "other": "SHUTTING_DOWN", "last": "CONTROLLER_INIT"}  # fmt: skip
    # --purge removes a service stuck SHUTTING_DOWN (no controller runs here) at once.
    result = sluice("down", "echo-?", "--purge", "-y", *ops_args)
    assert result.exit_code == 0 and "echo-a: purged" in result.stdout, result.output
    assert set(_statuses(ops_args)) == {"other", "last"}
    result = sluice("down", "-a", "-y", *ops_args)
    assert result.exit_code == 0, result.output
    assert _statuses(ops_args) == {"other": "SHUTTING_DOWN", "last": "SHUTTING_DOWN"}


def test_down_one_replica(echo_up: list[str], redis_url: str, redis_prefix: str) -> None:
    commit_ready(redis_url, redis_prefix, "echo", 7, 4321)

    failed = ReplicaRecord(id=8, status=ReplicaStatus.FAILED, backend="local")
    store_call(redis_url, redis_prefix, lambda s: s.commit("echo", replica_updates=[failed]))

    def replicas() -> dict[int, str]:
        [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
        return {r["id"]: r["status"] for r in view["replicas"]}

    assert sluice("down", "echo", "other", "--replica-id", "7", "-y", *echo_up).exit_code == 2
    assert sluice("up", str(ECHO), "-n", "echo2", *echo_up).exit_code == 0
    many = sluice("down", "echo*", "--replica-id", "7", "-y", *echo_up)
    assert many.exit_code == 2 and "matches echo, echo2" in many.stderr
    result = sluice("down", "echo", "--replica-id", "7", "-y", *echo_up)
    assert result.exit_code == 0 and "replica 7 terminated" in result.stdout, result.output
    assert replicas() == {7: "SHUTTING_DOWN", 8: "FAILED"}
    one_line_error(sluice("down", "echo", "--replica-id", "7", "-y", *echo_up),
                          "already shutting down")  # fmt: skip
    one_line_error(sluice("down", "echo", "--replica-id", "8", "-y", *echo_up),
                          "failed status (FAILED)", "--purge")  # fmt: skip
    result = sluice("down", "echo", "--replica-id", "8", "--purge", "-y", *echo_up)
    assert result.exit_code == 0 and "replica 8 purged" in result.stdout, result.output
    assert replicas() == {7: "SHUTTING_DOWN"}
    one_line_error(sluice("down", "echo", "--replica-id", "9", "-y", *echo_up),
                          "has no replica 9")  # fmt: skip
    assert sluice("status", "echo", *echo_up).exit_code == 0  # still there


def test_status_several_names_and_verbose(echo_up: list[str]) -> None:
    assert sluice("up", str(ECHO), "-n", "two", *echo_up).exit_code == 0
    assert sluice("up", str(ECHO), "-n", "three", *echo_up).exit_code == 0
    result = sluice("status", "echo", "three", "--json", *echo_up)
    assert [v["name"] for v in json.loads(result.stdout)] == ["echo", "three"]
    assert sluice("replica", "add", "echo", "http://127.0.0.1:9", *echo_up).exit_code == 0
    for flag in ("-v", "--verbose", "-a", "--all"):
        result = sluice("status", "echo", flag, *echo_up)
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert lines[1].split()[-2:] == ["POLICY", "UPDATE_MODE"]
        assert "least_load" in lines[2] and "rolling" in lines[2]
        header = next(line for line in lines if line.startswith("SERVICE_NAME"))
        assert header.split()[8:12] == ["BACKEND", "ACCELERATOR", "SPOT", "FIRST_READY"]
        assert header.split()[12:] == ["ENGINE", "RUNNING", "WAITING", "KV", "TTFT_P50/P99"]
    assert "BACKEND" not in sluice("status", "echo", *echo_up).stdout


def test_duration() -> None:
    assert [duration(s) for s in (0, 59, 61, 3600 * 2 + 120, 86400 * 3 + 3600)] == [
        "0s", "59s", "1m 1s", "2h 2m", "3d 1h"
    ]  # fmt: skip


# -- following snapshots ---------------------------------------------------------------------


async def test_follow_snapshots_yields_each_new_generation(
    store: Store, redis_url: str, redis_prefix: str
) -> None:
    from controlplane.records import ServiceRecord

    await store.register_service(ServiceRecord(name="f"), b"{}")
    seen: list[int] = []
    stream = store.follow_snapshots("f", resync_interval=30)
    async with asyncio.timeout(10):
        first = await anext(stream)
        seen.append(first.generation)
        for i in range(3):
            await store.commit("f", replica_updates=[
                ReplicaRecord(id=i + 1, status=ReplicaStatus.READY, url=f"http://{HOST}:{2000 + i}")
            ])  # fmt: skip
            seen.append((await anext(stream)).generation)
    await stream.aclose()
    assert seen == [1, 2, 3, 4]


async def test_follow_snapshots_unreachable() -> None:
    async with Store.from_url(dead_redis_url()) as dead:
        stream = dead.follow_snapshots("x")
        with pytest.raises(StoreUnavailable):
            async with asyncio.timeout(10):
                await anext(stream)


# -- real processes --------------------------------------------------------------------------


def _wait_http_200(proc: subprocess.Popen[bytes], port: int, log: Path, within: float) -> None:
    def answered() -> bool:
        assert proc.poll() is None, f"sluice run exited with {proc.returncode}:\n{log.read_text()}"
        with contextlib.suppress(OSError):
            status, body = http_get(HOST, port, "/hello", timeout=2.0)
            if status == 200:
                assert json.loads(body)["path"] == "/hello"
                return True
        return False

    until_sync(answered, timeout=within, what=f"a 200 from /hello on port {port}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_serves_then_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    log = tmp_path / "run.log"
    argv = ["run", str(ECHO), "--state-dir", str(state), "--host", HOST, "--port", str(port),
            "--drain-seconds", "1", "--down-timeout", "30"]  # fmt: skip
    with sluice_child(argv, log) as proc:
        _wait_http_200(proc, port, log, within=60)

        info = json.loads((state / "run.json").read_text())
        assert info["pid"] == proc.pid and info["endpoint"] == f"http://{HOST}:{port}"
        assert set(info["pids"]) == {"redis", "controller", "proxy"}
        password = Path(info["redis_password_file"]).read_text()  # not in run.json itself
        client = redis.Redis.from_url(info["redis_url"], password=password)
        try:
            records = client.hgetall("sluice:svc:echo:replicas").values()
        finally:
            client.close()
        replica_pids = [json.loads(r)["handle"]["pid"] for r in records]
        assert len(replica_pids) == 2
        started = {*info["pids"].values(), *replica_pids, *descendants(proc.pid)}
        assert all(running(pid) for pid in replica_pids)

        # Ops commands find the run's Redis through its state dir. The first 200 needs
        # one ready replica; the second may still be starting on a busy machine.
        def ready() -> int:
            status = CliRunner().invoke(
                cli, ["status", "echo", "--json", "--state-dir", str(state)]
            )
            assert status.exit_code == 0, status.output
            count: int = json.loads(status.stdout)[0]["ready"]
            return count

        until_sync(lambda: ready() == 2, timeout=60, what="2 replicas ready", interval=0.2)

        proc.send_signal(signal.SIGINT)
        code = wait_exit(proc, log, within=60)
        output = log.read_text()
        left = sorted(pid for pid in started if running(pid))
        kill_all(left)
    assert code == 0, output
    assert left == [], f"left running: {left}\n{output}"
    assert not (state / "run.json").exists()
    assert "sluice: stopped" in output
    assert "Traceback" not in output


@pytest.mark.slow
def test_run_with_a_sentinel_url_serves_and_stops(
    tmp_path: Path, sentinel_factory: Any, redis_prefix: str
) -> None:
    """`sluice run --redis redis+sentinel://...`: its controller and proxy both get the
    sentinel URL, the service serves, Ctrl-C stops it (the sentinels' Redis stays)."""
    group = sentinel_factory()
    state, port = tmp_path / "state", free_port()
    log = tmp_path / "run.log"
    argv = ["run", str(ECHO), "--redis", group.url, "--prefix", redis_prefix,
            "--state-dir", str(state), "--host", HOST, "--port", str(port),
            "--drain-seconds", "1", "--down-timeout", "30"]  # fmt: skip
    with sluice_child(argv, log) as proc:
        _wait_http_200(proc, port, log, within=60)
        info = json.loads((state / "run.json").read_text())
        assert info["redis_url"] == group.url
        assert "redis" not in info["pids"]  # no embedded redis-server

        def ready() -> int:
            status = CliRunner().invoke(
                cli, ["status", "echo", "--json", "--state-dir", str(state)]
            )
            assert status.exit_code == 0, status.output
            return int(json.loads(status.stdout)[0]["ready"])

        # Serving means one replica is READY; the second may follow a moment later.
        until_sync(lambda: ready() == 2, timeout=60, what="both replicas READY")
        proc.send_signal(signal.SIGINT)
        code = wait_exit(proc, log, within=60)
    output = log.read_text()
    assert code == 0, output
    assert "Traceback" not in output


@pytest.mark.parametrize("extra", [[], ["--tail", "1", "--follow"]])
def test_logs_follow_until_ctrl_c(tmp_path: Path, extra: list[str]) -> None:
    state = tmp_path / "st"
    state.mkdir()
    controller_log = state / "controller.log"
    controller_log.write_text("zero\none\n" if extra else "one\n")
    out = tmp_path / "follow.out"
    # Follows by default (as `sky serve logs`); --tail N with --follow: the last N, then on.
    argv = ["logs", "svc", "--controller", "--state-dir", str(state), *extra]
    with sluice_child(argv, out) as proc:
        def printed(text: str) -> bool:
            assert proc.poll() is None, out.read_text()
            return out.read_text() == text

        until_sync(lambda: printed("one\n"), timeout=20, what="the first line")
        with controller_log.open("a") as fh:
            fh.write("two\n")
        until_sync(lambda: printed("one\ntwo\n"), timeout=20, what="the appended line")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, out.read_text()


@pytest.mark.slow
def test_snapshot_watch_follows_generations_until_ctrl_c(
    tmp_path: Path, echo_up: list[str], redis_url: str, redis_prefix: str
) -> None:
    log = tmp_path / "watch.log"
    with sluice_child(["snapshot", "echo", "--watch", "--json", *echo_up], log) as proc:

        def lines(n: int) -> list[ReadySnapshot]:
            def printed() -> list[str] | None:
                got = log.read_text().splitlines()
                if len(got) >= n:
                    return got
                assert proc.poll() is None, log.read_text()
                return None

            got = until_sync(printed, timeout=20, what=f"{n} snapshot lines")
            return [msgspec.json.decode(line, type=ReadySnapshot) for line in got]

        assert [s.generation for s in lines(1)] == [1]
        commit_ready(redis_url, redis_prefix, "echo", 1, 4001)
        commit_ready(redis_url, redis_prefix, "echo", 2, 4002)
        snaps = lines(3)
        assert [s.generation for s in snaps] == [1, 2, 3]
        assert len(snaps[-1].replicas) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


TLS_YAML = """\
name: echo
service:
  readiness_probe: /health
  replicas: 1
  tls:
    keyfile: ~/certs/key.pem
    certfile: ~/certs/cert.pem
run: exec python -m tests.support.replica_app --port $PORT --id $SLUICE_REPLICA_ID
"""


def test_run_with_tls_paths_under_home_that_do_not_exist(tmp_path: Path) -> None:
    spec = tmp_path / "tls.yaml"
    spec.write_text(TLS_YAML)
    state = tmp_path / "state"
    result = sluice("run", str(spec), "--state-dir", str(state), env={"HOME": str(tmp_path)})
    one_line_error(
        result, f"service.tls.certfile: no file at {tmp_path}/certs/cert.pem", "'~/certs/cert.pem'"
    )
    assert not state.exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_serves_https_with_tls_paths_under_home(tmp_path: Path) -> None:
    import ssl

    import trustme

    home = tmp_path / "home"
    (home / "certs").mkdir(parents=True)
    ca = trustme.CA()
    cert = ca.issue_cert(HOST)
    cert.private_key_pem.write_to_path(str(home / "certs" / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(home / "certs" / "cert.pem"))
    spec = tmp_path / "tls.yaml"
    spec.write_text(TLS_YAML.replace("exec python", f"exec {sys.executable}"))
    state, port, log = tmp_path / "state", free_port(), tmp_path / "run.log"
    argv = ["run", str(spec), "--state-dir", str(state), "--host", HOST, "--port", str(port),
            "--drain-seconds", "0", "--down-timeout", "30"]  # fmt: skip
    context = ssl.create_default_context()
    ca.configure_trust(context)
    with sluice_child(argv, log, env={"HOME": str(home)}) as proc:
        def served() -> bool:
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
            with contextlib.suppress(OSError):
                conn = http.client.HTTPSConnection(HOST, port, timeout=2, context=context)
                try:
                    conn.request("GET", "/fast")
                    return conn.getresponse().status == 200
                finally:
                    conn.close()
            return False

        until_sync(served, timeout=60, what=f"a 200 over HTTPS on port {port}")
        info = json.loads((state / "run.json").read_text())
        assert info["endpoint"] == f"https://{HOST}:{port}"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()


# -- replicas on the YAML's fixed port (most Sky Serve YAMLs: `vllm serve --port 8080`) -----


def _fixed_port_yaml(tmp_path: Path, replicas: int, run: str, probe: str = "/health") -> Path:
    path = tmp_path / f"fixed-{replicas}-{abs(hash((run, probe)))}.yaml"
    path.write_text(
        f"service:\n  readiness_probe: {probe}\n  replicas: {replicas}\n  ports: 8080\n"
        f"resources:\n  ports: 8080\nrun: {run}\n"
    )
    return path


def test_a_fixed_replica_port_allows_one_local_replica(
    tmp_path: Path, ops_args: list[str], redis_url: str, redis_prefix: str
) -> None:
    two = _fixed_port_yaml(tmp_path, 2, "vllm serve Qwen/Qwen3-0.6B --port 8080")
    line = one_line_error(sluice("up", str(two), "-n", "llm", *ops_args),
                                 "fixed port 8080", "up to 2", "$PORT")  # fmt: skip
    assert "Traceback" not in line and redis_keys(redis_url, redis_prefix) == []
    result = sluice("run", str(two), "-n", "llm", "--state-dir", str(tmp_path / "run"))
    one_line_error(result, "fixed port 8080")
    assert not (tmp_path / "run").exists()  # nothing was started

    # Through an env var of the YAML, the port is as fixed.
    env = tmp_path / "env.yaml"
    env.write_text(two.read_text().replace("--port 8080", "--port $VLLM_PORT")
                   + "envs:\n  VLLM_PORT: 8080\n")  # fmt: skip
    one_line_error(sluice("up", str(env), "-n", "llm", *ops_args), "fixed port 8080")
    # Listening on $PORT, or a program that reads PORT itself (its run command names no
    # port, like examples/echo.yaml): any number of replicas, each on its own port.
    dollar = _fixed_port_yaml(tmp_path, 2, "vllm serve Qwen/Qwen3-0.6B --port $PORT")
    assert sluice("up", str(dollar), "-n", "ok", *ops_args).exit_code == 0
    reads_env = _fixed_port_yaml(tmp_path, 2, "python3 server.py --workers 18080")
    assert sluice("up", str(reads_env), "-n", "ok2", *ops_args).exit_code == 0
    # One replica on the fixed port is fine, and a count-only update too; an update that
    # replaces the replica cannot start the new one while the old one holds the port.
    one = _fixed_port_yaml(tmp_path, 1, "vllm serve Qwen/Qwen3-0.6B --port 8080")
    assert sluice("up", str(one), "-n", "llm", *ops_args).exit_code == 0
    probe = _fixed_port_yaml(tmp_path, 1, "vllm serve Qwen/Qwen3-0.6B --port 8080", "/v1/models")
    assert sluice("update", "llm", str(probe), *ops_args).exit_code == 0
    other = _fixed_port_yaml(tmp_path, 1, "vllm serve Qwen/Qwen3-8B --port 8080")
    one_line_error(sluice("update", "llm", str(other), *ops_args),
                          "fixed port 8080", "cannot start while the old one")  # fmt: skip
    # `sluice run`'s proxy cannot take the replica's port either.
    result = sluice("run", str(one), "--port", "8080", "--state-dir", str(tmp_path / "run"))
    one_line_error(result, "--port 8080", "another --port")


async def test_status_flags_a_proxy_lagging_behind(
    redis_url: str, redis_prefix: str, store: Store
) -> None:
    from proxy.config import ProxyConfig
    from proxy.readyset import ReadySet
    from proxy.sources.redis import RedisSource
    from proxy.stats import Stats

    ops_args = ["--redis", redis_url, "--prefix", redis_prefix]

    async def run_sluice(*args: str) -> str:
        """The real `sluice` in a subprocess (CliRunner swaps sys.stdout: not from a thread
        while this loop runs)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "controlplane.cli", *args, *ops_args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    await run_sluice("up", str(ECHO), "-n", "echo", "-y")
    ready = ReplicaRecord(id=1, status=ReplicaStatus.READY, url="http://127.0.0.1:23101")
    first = await store.commit("echo", replica_updates=[ready])
    sets, sources = [], []
    for proxy_id in ("live", "stopped"):
        config = ProxyConfig(redis_url=redis_url, service="echo", redis_prefix=redis_prefix,
                             proxy_id=proxy_id)
        ready_set = ReadySet()
        source = RedisSource(config, Stats(), flush_interval=0.02)
        await source.start(ready_set)
        sets.append(ready_set)
        sources.append(source)
    try:
        await until(lambda: all(s.generation == first.generation for s in sets))
        await sources[1].aclose()  # its last heartbeat stays at the first generation
        for port in (23102, 23103, 23104):
            last = await store.commit("echo", replica_updates=[
                ReplicaRecord(id=port - 23100, status=ReplicaStatus.READY,
                              url=f"http://127.0.0.1:{port}")])
        async def caught_up() -> bool:  # both heartbeats written, the live one at the last
            beats = await store.telemetry.read_proxies("echo")
            return set(beats) == {"live", "stopped"} and beats["live"].generation == last.generation

        await until(caught_up, timeout=5.0, what="the heartbeats to catch up")
        result = await run_sluice("status", "echo", "--json")
        proxies = {p["id"]: p for p in json.loads(result)[0]["proxies"]}
        assert proxies["live"]["generation"] == last.generation
        assert not proxies["live"]["lagging"]
        assert proxies["stopped"]["lag_generations"] == 3
        assert proxies["stopped"]["lagging"]
        loose = await run_sluice("status", "echo", "--json", "--max-lag-generations", "5",
                                 "--max-lag-seconds", "3600")
        assert not any(p["lagging"] for p in json.loads(loose)[0]["proxies"])
        text = await run_sluice("status", "echo")
        assert "echo: 1 of 2 proxies lagging" in text
        assert "LAGGING" in text
    finally:
        await sources[0].aclose()
        for ready_set in sets:
            ready_set.close()
