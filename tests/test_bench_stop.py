"""A bench stopped by `kill` (SIGTERM) stops the processes it started: by default SIGTERM
ends Python at once, and bench/real_engines.py left its four llama-servers running (a
core each) until someone found them (tests/support/pids.interrupt_on_sigterm)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import llama
from tests.support.pids import descendants, kill_all, running
from tests.support.poll import until_sync
from tests.support.processes import REPO


@pytest.mark.slow
def test_real_engines_stopped_by_sigterm_stops_its_llama_servers(tmp_path: Path) -> None:
    reason = llama.unavailable()
    if reason:
        pytest.skip(reason)
    llama.model_path()  # written before the bench starts, not while it is being stopped
    log = tmp_path / "bench.log"
    with log.open("wb") as out:
        bench = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "real_engines.py"), "--targets", "prefix",
             "--servers", "2", "--duration", "60", "--keep-logs", str(tmp_path / "logs")],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    started: list[int] = []
    try:
        # Both servers and the proxy up: the bench is inside its cell, driving requests.
        def servers_and_proxy() -> bool:
            started[:] = descendants(bench.pid)
            names = [_name(pid) for pid in started]
            return names.count("llama-server") == 2 and len(started) >= 3

        until_sync(servers_and_proxy, timeout=120, what="the bench's llama-servers and proxy")
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) != 0  # interrupted, not finished
        until_sync(lambda: not any(running(pid) for pid in started), timeout=30,
                   what="every process the bench started to stop")  # fmt: skip
    finally:
        kill_all([*started, bench.pid])
        bench.wait(timeout=10)


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
