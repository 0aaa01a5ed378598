"""The `sluice` CLI: parsing and one-line errors with click's CliRunner, the ops commands
against the real redis-server fixture, and `sluice run` / `sluice snapshot --watch` as
real processes stopped with SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis
from click.testing import CliRunner, Result

from controlplane.cli import cli
from controlplane.display import duration
from controlplane.models import ReplicaRecord, ReplicaStatus
from controlplane.store import Store, StoreUnavailable
from proxy.snapshot import ReadySnapshot
from tests.fixtures_replicas import HOST, REPO, free_port, http_get

ECHO = REPO / "examples" / "echo.yaml"


# -- helpers ---------------------------------------------------------------------------------


def sluice(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def assert_one_line_error(result: Result, *needles: str) -> str:
    """Exit 1, exactly one line on stderr ("Error: ..."), no traceback; returns the line."""
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def keys(url: str, prefix: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()


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

    async def main() -> None:
        async with Store.from_url(url, prefix=prefix) as store:
            record = ReplicaRecord(
                id=replica_id,
                status=ReplicaStatus.READY,
                url=f"http://{HOST}:{port}",
                backend="external",
                launched_at=time.time(),
                first_ready_at=time.time(),
            )
            await store.commit(name, replica_updates=[record])

    asyncio.run(main())


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
    line = assert_one_line_error(sluice("up", str(bad), "-n", "svc", *ops_args), field)
    assert str(bad) in line
    assert keys(redis_url, redis_prefix) == []
    # update and run load the spec before anything else too.
    assert_one_line_error(sluice("update", "svc", str(bad), *ops_args), field)
    state = tmp_path / "run-state"
    result = sluice("run", str(bad), "--redis", redis_url, "--prefix", redis_prefix,
                    "--state-dir", str(state))  # fmt: skip
    assert_one_line_error(result, field)
    assert keys(redis_url, redis_prefix) == []
    assert not (state / "run.json").exists()


def test_missing_file(tmp_path: Path, ops_args: list[str]) -> None:
    assert_one_line_error(sluice("up", str(tmp_path / "nope.yaml"), *ops_args),
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
    assert_one_line_error(sluice(*args, *ops_args), "no service 'ghost'")


@pytest.mark.parametrize(
    "args", [["status"], ["down", "x"], ["snapshot", "x"], ["up", str(ECHO)], ["run", str(ECHO)]]
)
def test_unreachable_redis_names_the_url(args: list[str], tmp_path: Path) -> None:
    url = dead_redis_url()
    result = sluice(*args, "--redis", url, "--state-dir", str(tmp_path))
    assert_one_line_error(result, f"cannot reach Redis at {url}")


def test_unreachable_redis_hides_the_password(tmp_path: Path) -> None:
    port = free_port()
    result = sluice("status", "--redis", f"redis://:s3cret@{HOST}:{port}/0",
                    "--state-dir", str(tmp_path))  # fmt: skip
    line = assert_one_line_error(result, "cannot reach Redis at redis://:***@")
    assert "s3cret" not in result.output and "s3cret" not in line


def test_bad_redis_url(tmp_path: Path) -> None:
    result = sluice("status", "--redis", "localhost:6379", "--state-dir", str(tmp_path))
    assert_one_line_error(result, "redis")


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
    assert_one_line_error(result, "another `sluice run`", str(os.getppid()))
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_run_refuses_an_existing_service(
    echo_up: list[str], redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    state = tmp_path / "run-state"
    result = sluice("run", str(ECHO), "--redis", redis_url, "--prefix", redis_prefix,
                    "--state-dir", str(state))  # fmt: skip
    assert_one_line_error(result, "service 'echo' already exists")
    assert not (state / "run.json").exists()
    assert not (state / "controller.log").exists()  # no process was started


def test_logs_needs_exactly_one_source(tmp_path: Path) -> None:
    for args in (["logs", "svc"], ["logs", "svc", "--controller", "--replica", "1"]):
        result = sluice(*args, "--state-dir", str(tmp_path))
        assert result.exit_code == 2
        assert "choose one of" in result.stderr


def test_status_endpoint_needs_a_name(ops_args: list[str]) -> None:
    result = sluice("status", "--endpoint", *ops_args)
    assert result.exit_code == 2


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

    assert_one_line_error(sluice("up", str(ECHO), "-n", "echo", *echo_up), "already exists")


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

    result = sluice("down", "echo", *echo_up)
    assert result.exit_code == 0, result.output
    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    assert view["status"] == "SHUTTING_DOWN"
    assert_one_line_error(sluice("update", "echo", str(ECHO), *echo_up), "shutting down")


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

    assert_one_line_error(sluice("replica", "add", "echo", url, *echo_up), "already has replica")
    result = sluice("replica", "add", "echo", "ftp://127.0.0.1:9", *echo_up)
    assert result.exit_code == 2 and "http(s)" in result.stderr

    result = sluice("replica", "remove", "echo", url, *echo_up)
    assert result.exit_code == 0, result.output
    [view] = json.loads(sluice("status", "echo", "--json", *echo_up).stdout)
    assert view["replicas"][0]["status"] == "SHUTTING_DOWN"
    assert_one_line_error(sluice("replica", "remove", "echo", "http://127.0.0.1:10", *echo_up),
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

    async def add_local_replica() -> None:
        async with Store.from_url(redis_url, prefix=redis_prefix) as store:
            record = ReplicaRecord(id=3, status=ReplicaStatus.STARTING, backend="local",
                                   handle={"pid": 1, "log": str(elsewhere)})  # fmt: skip
            await store.commit("echo", replica_updates=[record])

    asyncio.run(add_local_replica())
    assert sluice("logs", "echo", "--controller", *echo_up).stdout == "controller line\n"
    assert sluice("logs", "echo", "--proxy", *echo_up).stdout == "proxy line\n"
    # The handle's log path when the record has one; the backend's default path otherwise.
    assert sluice("logs", "echo", "--replica", "3", *echo_up).stdout == "replica three\n"
    assert sluice("logs", "echo", "--replica", "2", *echo_up).stdout == "replica two\n"
    assert_one_line_error(sluice("logs", "echo", "--replica", "9", *echo_up), "no replica 9")
    assert_one_line_error(sluice("logs", "other", "--proxy", *echo_up), "no log at")


def test_duration() -> None:
    assert [duration(s) for s in (0, 59, 61, 3600 * 2 + 120, 86400 * 3 + 3600)] == [
        "0s", "59s", "1m 1s", "2h 2m", "3d 1h"
    ]  # fmt: skip


# -- following snapshots ---------------------------------------------------------------------


async def test_follow_snapshots_yields_each_new_generation(
    store: Store, redis_url: str, redis_prefix: str
) -> None:
    from controlplane.models import ServiceRecord

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


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}") else []:
        with contextlib.suppress(OSError):
            for kid in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                out += [int(kid), *_descendants(int(kid))]
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (orphans may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child of this test; on the way out, it and whatever it started are SIGKILLed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", *argv], cwd=REPO,
                                env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() is None:
                _kill_all([proc.pid, *_descendants(proc.pid)])
            proc.wait(10)


def _wait_http_200(proc: subprocess.Popen[bytes], port: int, log: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        assert proc.poll() is None, f"sluice run exited with {proc.returncode}:\n{log.read_text()}"
        with contextlib.suppress(OSError):
            status, body = http_get(HOST, port, "/hello", timeout=2.0)
            if status == 200:
                assert json.loads(body)["path"] == "/hello"
                return
        assert time.monotonic() < deadline, f"no 200 within {within}s:\n{log.read_text()}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_serves_then_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    log = tmp_path / "run.log"
    argv = ["run", str(ECHO), "--state-dir", str(state), "--host", HOST, "--port", str(port),
            "--drain-seconds", "1", "--down-timeout", "30"]  # fmt: skip
    with _process(argv, log) as proc:
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
        started = {*info["pids"].values(), *replica_pids, *_descendants(proc.pid)}
        assert all(_running(pid) for pid in replica_pids)

        # Ops commands find the run's Redis through its state dir.
        status = CliRunner().invoke(cli, ["status", "echo", "--json", "--state-dir", str(state)])
        assert status.exit_code == 0, status.output
        assert json.loads(status.stdout)[0]["ready"] == 2

        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"sluice run still running 60s after SIGINT:\n{log.read_text()}")
        output = log.read_text()
        left = sorted(pid for pid in started if _running(pid))
        _kill_all(left)
    assert code == 0, output
    assert left == [], f"left running: {left}\n{output}"
    assert not (state / "run.json").exists()
    assert "sluice: stopped" in output
    assert "Traceback" not in output


def test_logs_follow_until_ctrl_c(tmp_path: Path) -> None:
    state = tmp_path / "st"
    state.mkdir()
    controller_log = state / "controller.log"
    controller_log.write_text("one\n")
    out = tmp_path / "follow.out"
    argv = ["logs", "svc", "--controller", "--follow", "--state-dir", str(state)]
    with _process(argv, out) as proc:
        deadline = time.monotonic() + 20
        while out.read_text() != "one\n":
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        with controller_log.open("a") as fh:
            fh.write("two\n")
        while out.read_text() != "one\ntwo\n":
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, out.read_text()


@pytest.mark.slow
def test_snapshot_watch_follows_generations_until_ctrl_c(
    tmp_path: Path, echo_up: list[str], redis_url: str, redis_prefix: str
) -> None:
    log = tmp_path / "watch.log"
    with _process(["snapshot", "echo", "--watch", "--json", *echo_up], log) as proc:

        def lines(n: int) -> list[ReadySnapshot]:
            deadline = time.monotonic() + 20
            while True:
                got = log.read_text().splitlines()
                if len(got) >= n:
                    return [msgspec.json.decode(line, type=ReadySnapshot) for line in got]
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)

        assert [s.generation for s in lines(1)] == [1]
        commit_ready(redis_url, redis_prefix, "echo", 1, 4001)
        commit_ready(redis_url, redis_prefix, "echo", 2, 4002)
        snaps = lines(3)
        assert [s.generation for s in snaps] == [1, 2, 3]
        assert len(snaps[-1].replicas) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, log.read_text()
    assert "Traceback" not in log.read_text()
