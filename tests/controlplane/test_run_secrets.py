"""`sluice run`'s secrets, against a real run (redis-server, controller, proxy, replica):
the embedded Redis needs a password; the password is in a 0600 file, never in run.json
or any process's argv; logs and state files are 0600/0700; the replica's environment is
the allow-list plus its own variables (it dumps its environment to a file to show it).
Also the local backend alone: a replica never inherits the controller's Redis URL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from controlplane.backends.local import HOST_ENV_NAMES, HOST_ENV_PREFIXES, LocalBackend
from controlplane.redisserver import EmbeddedRedis
from controlplane.servicespec import parse_spec
from tests.support.cli import sluice, spawn_sluice
from tests.support.pids import descendants, kill_all
from tests.support.poll import until, until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, ProxyFactory, http_get

HOST_SECRET = "host-secret-not-for-replicas"
SECRET_URL = "redis://:replica-must-not-see-this@127.0.0.1:1/0"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _env_dump(path: Path) -> dict[str, str]:
    entries = [e for e in path.read_bytes().split(b"\0") if e]
    return dict(e.decode().partition("=")[::2] for e in entries)


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    state: Path
    log: Path
    env_out: Path
    info: dict[str, object]
    pids: list[int]  # sluice run and everything it started, replicas included


SPEC = """\
name: envdump
service:
  readiness_probe: /health
  replicas: 1
workdir: {workdir}
envs:
  GREETING: hello
  ENV_OUT: {env_out}
run: env -0 > "$ENV_OUT.$SLUICE_REPLICA_ID"; exec python3 echo_server.py
"""


@pytest.fixture(scope="module")
def sluice_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One `sluice run` with its embedded Redis, serving one replica; SIGINT at the end,
    then nothing it started may still run."""
    tmp = tmp_path_factory.mktemp("run")
    state, log, env_out = tmp / "state", tmp / "run.log", tmp / "replica-env"
    spec = tmp / "envdump.yaml"
    spec.write_text(SPEC.format(workdir=REPO / "examples", env_out=env_out))
    port = free_port()
    env = {"MY_CLOUD_TOKEN": HOST_SECRET, "CUDA_VISIBLE_DEVICES": "0", "LC_ALL": "C.UTF-8",
           "SLUICE_REDIS_URL": None, "SLUICE_REDIS_CA_FILE": None,
           "SLUICE_STATE_DIR": None}  # fmt: skip
    argv = ["run", str(spec), "--state-dir", str(state), "--host", HOST, "--port", str(port),
            "--drain-seconds", "0", "--down-timeout", "20"]  # fmt: skip
    proc = spawn_sluice(argv, log, env)
    started: set[int] = {proc.pid}
    try:
        def served() -> bool:
            assert proc.poll() is None, f"sluice run exited:\n{log.read_text()}"
            with contextlib.suppress(OSError):
                return http_get(HOST, port, "/hello", timeout=2.0)[0] == 200
            return False

        until_sync(served, timeout=60, what=f"a 200 from /hello on port {port}")
        info = json.loads((state / "run.json").read_text())
        started.update(descendants(proc.pid))
        yield Run(proc, state, log, env_out, info, sorted(started))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert not (state / "redis" / "password").exists()  # removed with run.json
    finally:
        if proc.poll() is None:
            started.update(descendants(proc.pid))
        kill_all(started)
        proc.wait(10)
    assert "Traceback" not in log.read_text()


def _password(run: Run) -> str:
    path = run.info.get("redis_password_file")
    assert isinstance(path, str), f"run.json names no password file: {run.info}"
    return Path(path).read_text().strip()


def _secrets(run: Run) -> list[str]:
    """The run's Redis password, if it has one, and the host's secret variable."""
    path = run.info.get("redis_password_file")
    password = [Path(path).read_text().strip()] if isinstance(path, str) else []
    return [*password, HOST_SECRET]


@pytest.mark.slow
def test_embedded_redis_refuses_clients_without_the_password(sluice_run: Run) -> None:
    port = int(str(sluice_run.info["redis_url"]).rsplit(":", 1)[1].split("/")[0])
    stranger = redis.Redis(host=HOST, port=port)
    try:
        with pytest.raises(redis.AuthenticationError):
            stranger.sadd("sluice:services", "evil")
    finally:
        stranger.close()
    # The ops commands find the password through the state dir.
    status = sluice("status", "envdump", "--json", "--state-dir", str(sluice_run.state))
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)[0]["ready"] == 1


@pytest.mark.slow
def test_password_kept_in_a_private_file_not_in_run_json(sluice_run: Run) -> None:
    password = _password(sluice_run)
    assert len(password) >= 32
    assert password not in (sluice_run.state / "run.json").read_text()
    assert "@" not in str(sluice_run.info["redis_url"])
    secret_file = Path(str(sluice_run.info["redis_password_file"]))
    assert _mode(secret_file) == 0o600
    assert _mode(secret_file.parent) == 0o700
    assert _mode(secret_file.parent / "redis.conf") == 0o600  # requirepass is in there


@pytest.mark.slow
def test_no_secret_in_the_argv_of_any_child(sluice_run: Run) -> None:
    secrets = _secrets(sluice_run)
    seen = 0
    for pid in sluice_run.pids:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            seen += 1
            assert "redis://" not in argv and "rediss://" not in argv, (pid, argv)
            assert not [s for s in secrets if s in argv], (pid, argv)
    assert seen >= 5, sluice_run.pids  # sluice run, redis, controller, proxy, replica


@pytest.mark.slow
def test_logs_and_state_files_are_private(sluice_run: Run) -> None:
    state = sluice_run.state
    assert _mode(state) == 0o700  # created by sluice run
    service_dir = state / "envdump"
    assert _mode(service_dir) == 0o700
    files = [state / "run.json", state / "controller.log", service_dir / "proxy.log",
             service_dir / "replica-1.log", service_dir / "replica-1.json"]  # fmt: skip
    files += list((state / "redis").iterdir())
    for path in files:
        if path.is_file():
            assert _mode(path) == 0o600, (path, oct(_mode(path)))
    # Nothing but the password file and redis.conf holds the password: no log, no state file.
    password = _password(sluice_run)
    for path in [*state.rglob("*"), sluice_run.log]:
        if path.is_file() and path.name not in ("password", "redis.conf"):
            assert password not in path.read_text(errors="replace"), path


@pytest.mark.slow
def test_replica_gets_a_clean_environment(sluice_run: Run) -> None:
    env = _env_dump(Path(f"{sluice_run.env_out}.1"))
    assert not [k for k in env if k.startswith("SLUICE_") and k != "SLUICE_REPLICA_ID"], env
    assert "MY_CLOUD_TOKEN" not in env
    secrets = _secrets(sluice_run)
    assert not [k for k, v in env.items() if any(s in v for s in secrets)], env
    assert env["SLUICE_REPLICA_ID"] == env["SKYPILOT_SERVE_REPLICA_ID"] == "1"
    assert env["PORT"].isdigit() and env["GREETING"] == "hello"
    # The allow-list: where programs are, who and where we are, the GPU runtime.
    assert env["PATH"] == os.environ["PATH"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["LC_ALL"] == "C.UTF-8"
    if "HOME" in os.environ:
        assert env["HOME"] == os.environ["HOME"]


async def test_local_replica_never_inherits_the_controllers_redis_url(tmp_path: Path) -> None:
    host_env = {"PATH": os.environ["PATH"], "HOME": "/home/x", "LANG": "C.UTF-8",
                "SLUICE_REDIS_URL": SECRET_URL, "SLUICE_REDIS_CA_FILE": "/ca.pem",
                "AWS_SECRET_ACCESS_KEY": HOST_SECRET, "NVIDIA_VISIBLE_DEVICES": "all"}  # fmt: skip
    backend = LocalBackend(tmp_path / "state", base_env=host_env, term_timeout=2)
    out = tmp_path / "env"
    spec = parse_spec({"service": {"readiness_probe": "/", "replicas": 1},
                       "envs": {"OUT": str(out)}, "secrets": {"HF_TOKEN": "from-the-spec"},
                       "run": 'env -0 >"$OUT.tmp"; mv "$OUT.tmp" "$OUT"; exec sleep 30'})
    launched = await backend.launch("svc", 1, 1, spec)
    try:
        await until(out.exists, timeout=10, what="the replica's environment dump")
        env = _env_dump(out)
    finally:
        await backend.terminate(launched.handle)
    assert "SLUICE_REDIS_URL" not in env and "SLUICE_REDIS_CA_FILE" not in env
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["HF_TOKEN"] == "from-the-spec"  # the spec's own secrets do reach it
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["HOME"] == "/home/x"
    assert env["SLUICE_REPLICA_ID"] == "1" and env["PORT"].isdigit()
    assert _mode(tmp_path / "state" / "svc" / "replica-1.log") == 0o600


def test_the_documented_allow_list_is_the_one_in_force() -> None:
    for doc in ("security.md", "cli.md"):
        text = (REPO / "docs" / doc).read_text()
        missing = [n for n in (*HOST_ENV_NAMES, *HOST_ENV_PREFIXES) if n not in text]
        assert not missing, f"docs/{doc} does not list {missing}"


def test_proxy_workers_get_the_redis_url_from_the_environment_not_argv(
    redis_factory: Callable[..., EmbeddedRedis], proxy_factory: ProxyFactory
) -> None:
    # `--workers N` re-executes itself N times: the URL must not land in the workers' argv.
    server = redis_factory(password="proxy-workers-secret")
    proxy = proxy_factory("--service", "svc", workers=2, wait="health",
                          env={"SLUICE_REDIS_URL": server.url})  # fmt: skip
    pids = [proxy.pid, *proxy.worker_pids()]
    assert len(pids) >= 3, pids
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "proxy-workers-secret" not in argv and "redis://" not in argv, argv
