"""The first hour of a new user, through the real CLI (`python -m controlplane.cli` as a
child process): every step that used to fail silently or with the wrong words.

- `--dry-run` of up / update / run works with no Redis reachable, prints the normalised
  spec with secrets redacted, and exits 1 with one line for an invalid file;
- a file named like `lb_autoscale_wd.yaml` gives a valid service name, printed;
- what the local backend cannot run is refused naming the field and the backend that
  can, and `--backend skypilot` accepts it;
- `sluice run` of a replica that exits at once prints each replica's FAILED with its own
  reason and log, then exits 1 with a one-line summary; the controller log has a line
  per state change;
- `sluice run` of a spec without `run:` exits 1 at once, saying so;
- `sluice status` with no run on the state dir says that, not a Redis error;
- `sluice up` beside a `sluice run` says how to reach the new service; for one without
  `run:` (replicas from `sluice replica add`) `sluice status` says why none launches;
- the run output shows the listen address, the admin port and where the logs are.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.cli import sluice_child
from tests.support.poll import until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, http_get

ECHO = REPO / "examples" / "echo.yaml"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> (
        subprocess.CompletedProcess[str]):  # fmt: skip
    """`python -m controlplane.cli *args` to its end; SLUICE_REDIS_URL points at a port
    where nothing listens unless `env` says otherwise."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO),
                "SLUICE_STATE_DIR": str(Path(tempfile.gettempdir()) / "sluice-no-state-dir"),
                "SLUICE_REDIS_URL": f"redis://{HOST}:{free_port()}/0", **(env or {})}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


LLM = """\
envs:
  MODEL_NAME: qwen
  HF_TOKEN:
secrets:
  API_KEY:
service:
  readiness_probe:
    path: /v1/models
    headers:
      Authorization: Bearer $API_KEY
  replicas: 2
resources:
  accelerators: {L4:1, A10G:1}
  ports: 8081
run: vllm serve $MODEL_NAME --port 8081 --api-key $API_KEY
"""


# -- --dry-run -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["up", "run", "update"])
def test_dry_run_validates_without_redis_and_redacts_secrets(
    command: str, tmp_path: Path
) -> None:
    spec = tmp_path / "lb_autoscale_wd.yaml"
    spec.write_text(LLM)
    state = tmp_path / "state"
    target = ["update", "llm", str(spec)] if command == "update" else [command, str(spec)]
    proc = cli(*target, "--dry-run", "--backend", "skypilot", "--state-dir", str(state),
               "--env", "HF_TOKEN=hf_public", "--secret", "API_KEY=sk-very-secret")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "sk-very-secret" not in out + proc.stderr
    assert "API_KEY: <redacted>" in out
    assert "Authorization: Bearer <redacted>" in out  # substituted into the probe, too
    assert "HF_TOKEN: hf_public" in out and "L4:1: null" in out
    assert "backend: skypilot" in out and "run each replica as a SkyPilot cluster" in out
    assert out.rstrip().endswith("Redis was not contacted")
    if command != "update":
        assert "service name: lb-autoscale-wd (from the file name 'lb_autoscale_wd.yaml'" in out
    assert not state.exists()  # nothing started, nothing written


def test_dry_run_of_an_invalid_file_is_one_line_naming_the_flags(tmp_path: Path) -> None:
    spec = tmp_path / "llm.yaml"
    spec.write_text(LLM)
    proc = cli("up", str(spec), "--dry-run", "--backend", "skypilot")
    one_line(proc, "$.envs.HF_TOKEN: has no value", "--env HF_TOKEN=VALUE", "--env-file")
    proc = cli("up", str(spec), "--dry-run", "--backend", "skypilot", "--env", "HF_TOKEN=x")
    one_line(proc, "$.secrets.API_KEY: has no value", "--secret API_KEY=VALUE")


def test_local_limits_are_refused_for_the_local_backend_only(tmp_path: Path) -> None:
    spec = tmp_path / "llm.yaml"
    spec.write_text(LLM)
    args = ["--env", "HF_TOKEN=x", "--secret", "API_KEY=y", "--dry-run"]
    one_line(cli("run", str(spec), *args), "service.ports: the replicas listen on the fixed "
             "port 8081", "--backend skypilot")  # fmt: skip
    multi = tmp_path / "multi.yaml"
    multi.write_text(ECHO.read_text() + "num_nodes: 2\n")
    one_line(cli("up", str(multi), "--dry-run"), "num_nodes: 2 nodes per replica",
             "--backend skypilot")  # fmt: skip
    for path in (spec, multi):
        assert cli("up", str(path), *args, "--backend", "skypilot").returncode == 0


def test_a_name_with_nothing_valid_is_generated(tmp_path: Path) -> None:
    spec = tmp_path / "123_.yaml"
    spec.write_text(ECHO.read_text().replace("name: echo\n", ""))
    proc = cli("up", str(spec), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[0]
    assert line.startswith("service name: sluice-service-") and "(generated" in line


# -- status without a run --------------------------------------------------------------------


def test_status_without_a_run_says_so(tmp_path: Path) -> None:
    with socket.socket() as probe:  # the default URL's port: something may listen there
        if probe.connect_ex(("127.0.0.1", 6379)) == 0:
            pytest.skip("a Redis answers on 127.0.0.1:6379, the default URL")
    state = tmp_path / "state"
    proc = cli("status", "--state-dir", str(state), env={"SLUICE_REDIS_URL": ""})
    one_line(proc, f"no `sluice run` is active on this state dir ({state})", "--redis URL")


# -- sluice run: failures are said, and end the run ------------------------------------------

CRASH = """\
service:
  readiness_probe: /
  replicas: 2
run: echo "starting $SKYPILOT_SERVE_REPLICA_ID"; exit $((10 + SKYPILOT_SERVE_REPLICA_ID))
"""


def test_run_of_replicas_that_exit_says_why_per_replica_and_exits_1(tmp_path: Path) -> None:
    spec = tmp_path / "crash_test.yaml"
    spec.write_text(CRASH)
    state = tmp_path / "state"
    log = tmp_path / "run.log"
    argv = ["run", str(spec), "--state-dir", str(state), "--port", "0", "--drain-seconds",
            "0", "--down-timeout", "20"]  # fmt: skip
    with sluice_child(argv, log) as proc:
        code = proc.wait(120)
    out = log.read_text()
    assert code == 1, out
    assert "sluice: service name crash-test (from the file name 'crash_test.yaml'" in out
    failed = {line.split(" ")[2]: line for line in out.splitlines()
              if ": FAILED" in line and line.split(" ")[1] == "replica"}  # fmt: skip
    assert failed, out
    for replica_id, line in failed.items():  # each with its own exit code and log
        assert f"exited with code {10 + int(replica_id)}" in line, line
        assert f"(log: {state / 'crash-test' / f'replica-{replica_id}.log'})" in line, line
    last = out.strip().splitlines()[-1]
    assert last.startswith("sluice: crash-test can never become ready: version 1 stopped "
                           "launching: replica "), last  # fmt: skip
    blocked = last.split("replica ")[1].split(" ")[0]
    assert f"code {10 + int(blocked)}" in last and str(state / "controller.log") in last
    controller = (state / "controller.log").read_text()
    assert "service crash-test: launching replica 1 (v1) on the local backend" in controller
    for replica_id in failed:  # one line per change, with that replica's own reason
        code = 10 + int(replica_id)
        assert re.search(rf"service crash-test: replica {replica_id} \(v1\) [A-Z_]+ -> FAILED: "
                         rf"replica {replica_id} \(v1\): process exited with code {code}",
                         controller), controller  # fmt: skip
    assert "service crash-test: REPLICA_INIT -> FAILED" in controller
    assert "service crash-test: autoscaler: target 2 replicas (fixed)" in controller
    assert "service crash-test: terminate replica=1 version=1" in controller


def test_run_of_a_spec_without_run_fails_at_once(tmp_path: Path) -> None:
    spec = tmp_path / "norun.yaml"
    spec.write_text("service:\n  readiness_probe: /\n")
    state = tmp_path / "state"
    proc = cli("run", str(spec), "--state-dir", str(state), "--port", "0")
    one_line(proc, "run: the local backend runs a replica's `run` command")
    assert not (state / "controller.log").exists()


# -- sluice run: what it says, and `up` beside it ---------------------------------------------


def _answers(port: int) -> bool:
    try:
        return http_get(HOST, port, "/health")[0] == 200
    except OSError:
        return False


def test_run_shows_listen_admin_and_logs_and_up_beside_it_says_how_to_reach(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    port = free_port()
    log = tmp_path / "run.log"
    argv = ["run", str(ECHO), "--state-dir", str(state), "--port", str(port),
            "--drain-seconds", "0", "--down-timeout", "30"]  # fmt: skip
    with sluice_child(argv, log, env={"SLUICE_REDIS_URL": None}) as proc:
        until_sync(lambda: "is ready at" in log.read_text(), timeout=60,
                   what="the service ready", interval=0.1)  # fmt: skip
        out = log.read_text()
        info = json.loads((state / "run.json").read_text())
        admin = info["admin"]
        assert info["listen"] == f"127.0.0.1:{port}" and info["backend"] == "local"
        assert f"at http://127.0.0.1:{port} (the proxy listens on 127.0.0.1:{port}; " \
               f"admin {admin}/metrics)" in out
        assert f"--controller: {state / 'controller.log'}" in out
        admin_port = int(admin.rsplit(":", 1)[1])
        assert http_get(HOST, admin_port, "/healthz")[0] == 200
        assert http_get(HOST, port, "/")[0] == 200

        shown = cli("status", "--state-dir", str(state), env={"SLUICE_REDIS_URL": ""})
        assert f"its proxy listens on 127.0.0.1:{port} (endpoint http://127.0.0.1:{port}), " \
               f"admin {admin} (/metrics, /snapshot); backend local" in shown.stdout

        other = tmp_path / "other.yaml"
        other.write_text(ECHO.read_text().replace("name: echo", "name: other"))
        up = cli("up", str(other), "--state-dir", str(state), env={"SLUICE_REDIS_URL": ""})
        assert up.returncode == 0, up.stderr
        assert "other has no proxy: the one of the `sluice run` on this state dir serves " \
               "echo only" in up.stdout
        hint = up.stdout.split("SLUICE_REDIS_URL=", 1)[1].strip()
        assert hint.endswith("sluice proxy --service other --port PORT"), hint
        password = Path(info["redis_password_file"]).read_text()
        assert password not in up.stdout
        # The hint works as printed: a proxy for `other` on the run's Redis serves it.
        other_port = free_port()
        command = hint.replace("--port PORT", f"--port {other_port} --host {HOST} "
                               f"--admin-port {free_port()}")
        proxy = subprocess.Popen(["bash", "-c", f"SLUICE_REDIS_URL={command}"], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO),
                                      "PATH": f"{Path(sys.executable).parent}:"
                                              f"{os.environ['PATH']}"},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)  # fmt: skip
        try:
            until_sync(lambda: _answers(other_port), timeout=60, what="other's proxy",
                       interval=0.2)  # fmt: skip
        finally:
            os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(20)

        # A spec without `run:` registered beside it: the controller says why it gives up.
        norun = tmp_path / "norun.yaml"
        norun.write_text("service:\n  readiness_probe: /\n  replicas: 1\n")
        assert cli("up", str(norun), "--state-dir", str(state),
                   env={"SLUICE_REDIS_URL": ""}).returncode == 0  # fmt: skip

        def status() -> str:
            shown = cli("status", "norun", "--state-dir", str(state),
                        env={"SLUICE_REDIS_URL": ""})  # fmt: skip
            assert shown.returncode == 0, shown.stderr
            return shown.stdout if "NO_REPLICA" in shown.stdout else ""

        text = until_sync(status, timeout=60, what="norun NO_REPLICA", interval=0.2)
        assert "norun: version 1 has no `run` command: the controller launches no replica; " \
               "register them with `sluice replica add norun URL`" in text, text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
