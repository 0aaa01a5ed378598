"""Ctrl-C under `sluice run` drains like `sluice down`: a stream in flight finishes
(up to the drain bound; the wait for the replicas is that bound plus DOWN_SLACK unless
--down-timeout says otherwise), a second Ctrl-C stops at once. Real `sluice run`
processes, a real replica process, a real stream through the real proxy."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from controlplane.run.config import DOWN_SLACK, RunConfig
from controlplane.servicespec import load_spec
from tests.support.cli import sluice_child, wait_exit
from tests.support.pids import descendants
from tests.support.poll import until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, http_get

SPEC = f"""\
service:
  readiness_probe:
    path: /health
    endpoint_probe_interval_seconds: 0.5
  replicas: 1
workdir: {REPO}
run: exec {sys.executable} -m tests.support.replica_app --port $PORT --id $SLUICE_REPLICA_ID
"""


class Stream:
    """One SSE stream through the proxy, read in a thread: events received, how it ended."""

    def __init__(self, port: int, events: int, interval: float) -> None:
        self.events = 0
        self.ended: str | None = None
        self._path = f"/sse?n={events}&interval={interval}"
        self._port = port
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _read(self) -> None:
        conn = http.client.HTTPConnection(HOST, self._port, timeout=30)
        try:
            conn.request("GET", self._path)
            resp = conn.getresponse()
            while True:
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    self.events += 1
            self.ended = "complete"
        except (OSError, http.client.HTTPException) as exc:
            self.ended = type(exc).__name__
        finally:
            conn.close()


def _run(tmp_path: Path, *extra: str) -> tuple[list[str], int]:
    spec = tmp_path / "svc.yaml"
    spec.write_text(SPEC)
    port = free_port()
    argv = ["run", str(spec), "-n", "cc", "--state-dir", str(tmp_path / "state"),
            "--host", HOST, "--port", str(port), *extra]  # fmt: skip
    return argv, port


def _ready_stream(proc: subprocess.Popen[bytes], log: Path, port: int, events: int,
                  interval: float) -> Stream:  # fmt: skip
    """Once the service serves: a stream that has received its first event."""
    until_sync(lambda: "is ready at" in log.read_text() or proc.poll() is not None,
               timeout=60, what="the service ready")  # fmt: skip
    assert proc.poll() is None, log.read_text()
    stream = Stream(port, events, interval)
    stream.start()
    until_sync(lambda: stream.events > 0 or stream.ended is not None, timeout=15,
               what="the stream's first event")  # fmt: skip
    return stream


def _exit(proc: subprocess.Popen[bytes], log: Path, within: float) -> tuple[int, str]:
    return wait_exit(proc, log, within), log.read_text()


def test_the_wait_covers_the_drain_bound_unless_given() -> None:
    spec = load_spec(SPEC)
    # The default drain bound (Sky's 120 s) is no longer cut at a fixed 60 s.
    assert RunConfig(spec=spec, name="cc", state_dir=Path("/x")).down_wait == 120 + DOWN_SLACK
    assert RunConfig(spec=spec, name="cc", state_dir=Path("/x"),
                     drain_seconds=5).down_wait == 5 + DOWN_SLACK  # fmt: skip
    own = load_spec(SPEC.replace("  replicas: 1\n",
                                 "  replicas: 1\n  sluice:\n    max_drain_seconds: 300\n"))
    assert RunConfig(spec=own, name="cc", state_dir=Path("/x")).down_wait == 300 + DOWN_SLACK
    assert RunConfig(spec=own, name="cc", state_dir=Path("/x"),
                     down_timeout=7).down_wait == 7  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_lets_a_stream_finish_then_stops(tmp_path: Path) -> None:
    argv, port = _run(tmp_path, "--drain-seconds", "60")
    log = tmp_path / "run.log"
    with sluice_child(argv, log) as proc:
        # A 502 through the run's proxy (the replica resets the connection).
        until_sync(lambda: "is ready at" in log.read_text() or proc.poll() is not None,
                   timeout=60, what="the service ready")  # fmt: skip
        assert http_get(HOST, port, "/reset")[0] == 502
        info = json.loads((tmp_path / "state" / "run.json").read_text())
        password = Path(info["redis_password_file"]).read_text().strip()
        stream = _ready_stream(proc, log, port, events=30, interval=0.2)  # 6 s
        proc.send_signal(signal.SIGINT)
        stream.join(30)
        code, output = _exit(proc, log, within=60)
        assert descendants(proc.pid) == []
    assert (stream.ended, stream.events) == ("complete", 30), output
    assert code == 0, output
    assert "drain until idle, at most 60s; Ctrl-C again to stop at once" in output
    assert "Ctrl-C to stop (streams drain, up to 60s; twice: at once)" in output
    assert "below the drain bound" not in output and "stopping them directly" not in output
    # Issue 23: the proxy log says where its ready set comes from, what it listens on,
    # each snapshot it applied, and the 502 (never the Redis password).
    proxy_log = (tmp_path / "state" / "cc" / "proxy.log").read_text()
    assert password and password not in proxy_log
    for said in ("ready set from redis://127.0.0.1:", "(service cc)",
                 f"listening on {HOST}:{port} (http, worker 0 of 1)",
                 "redis source for cc: connected at generation",
                 "applied generation", "(1 replicas, policy ",
                 "upstream failure: service=cc replica=http://", "GET /reset status=502"):
        assert said in proxy_log, (said, proxy_log)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    argv, port = _run(tmp_path, "--drain-seconds", "60")
    log = tmp_path / "run.log"
    with sluice_child(argv, log) as proc:
        stream = _ready_stream(proc, log, port, events=300, interval=0.2)  # 60 s
        proc.send_signal(signal.SIGINT)
        until_sync(lambda: "taking cc down" in log.read_text(), timeout=10,
                   what="the drain announced")  # fmt: skip
        proc.send_signal(signal.SIGINT)
        code, output = _exit(proc, log, within=30)
        stream.join(10)
    assert code == 0, output
    assert "sluice: stopping at once" in output
    assert stream.ended is not None and stream.events < 300  # cut, not waited for


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_down_timeout_below_the_drain_bound_is_said_and_cuts(tmp_path: Path) -> None:
    argv, port = _run(tmp_path, "--drain-seconds", "60", "--down-timeout", "2")
    log = tmp_path / "run.log"
    with sluice_child(argv, log) as proc:
        stream = _ready_stream(proc, log, port, events=300, interval=0.2)  # 60 s
        proc.send_signal(signal.SIGINT)
        code, output = _exit(proc, log, within=40)
        stream.join(10)
    assert code == 0, output
    assert "--down-timeout 2s is below the drain bound: requests still running then are cut" \
        in output
    assert "replicas not terminated within 2s; stopping them directly" in output
    assert stream.ended is not None and stream.events < 300
