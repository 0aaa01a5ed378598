"""Sky Serve's real controller code (SkyPilot 0.14.1) driving sluice as its load balancer.

bench/skyserve_real.py does the work (its docstring says exactly what is real and
what is replaced: only the replica manager, by a named fake that returns local
replica URLs). It runs in its own virtualenv, because skypilot's pins must not
decide ours: `.ci/run` creates .venv-sky (and .venv-sky310 where a Python 3.10
interpreter exists) with skypilot==0.14.1, this checkout of sluice and
contrib/skyserve-shim. Without that venv the test is skipped, saying so.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.processes import REPO as ROOT

HARNESS = ROOT / "bench" / "skyserve_real.py"


def _venv_python(venv: str) -> Path:
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        why = ("no Python 3.10 interpreter here, so .ci/run made no .venv-sky310"
               if venv.endswith("310") else "run `bash .ci/run`, which creates it")
        pytest.skip(f"{venv} (skypilot==0.14.1 + sluice + contrib/skyserve-shim) is missing: "
                    f"{why}")
    return python


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("venv", "lb", "python"), [
    (".venv-sky", "sluice", "3.11"),
    (".venv-sky310", "sluice", "3.10"),
    (".venv-sky", "workers2", "3.11"),
], ids=["run_load_balancer-py3.11", "run_load_balancer-py3.10", "workers2-py3.11"])
def test_sky_serve_controller_drives_sluice(tmp_path, venv, lb, python) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [str(_venv_python(venv)), str(HARNESS), "--lb", lb, "--rate", "20",
         "--phase-seconds", "6", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["skypilot"] == "0.14.1" and res["python"].startswith(python)
    assert Path(res["sluice_from"]) == ROOT / "proxy", res["sluice_from"]
    phases = {p["phase"]: p for p in res["phases"]}
    assert list(phases) == ["2 replicas", "add one", "remove one", "one empty answer"]
    for p in res["phases"]:  # a replica added, one removed and killed, one empty answer
        assert p["sent"] == 120 and p["2xx"] == 120, res
    # A sync may time out on a busy box (it is resent); none may fail on a stale connection.
    assert res["stale_connection_syncs"] == 0, res["log_dir"]
    assert res["empty_answer_served"]
    assert res["replica_served"]["r3"] > 0, "the added replica never got traffic"
    # The controller's own RequestRateAutoscaler saw every request once, in order.
    assert res["autoscaler_requests"] == res["requests_sent"], res
    assert res["autoscaler_sorted"]
    assert res["autoscaler_qps"] == pytest.approx(res["requests_sent"] / 60)
    if lb == "sluice":
        # Started through the sluice-skyserve import hook: no SkyPilot file was edited.
        assert res["entry_point"] == "proxy.skyserve"
        assert res["lb_log_has_sluice"], "sluice's records missing from load_balancer.log"
