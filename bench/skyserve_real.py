"""Sky Serve's real controller with sluice (or Sky's own LB) as its load balancer.

Run with the Python of a venv that has skypilot==0.14.1, sluice and
contrib/skyserve-shim installed (.ci/run makes .venv-sky, and .venv-sky310 on
Python 3.10), from the repository root:

    .venv-sky/bin/python bench/skyserve_real.py --lb sluice --json out.json
    .venv-sky/bin/python bench/skyserve_real.py --table   # every variant, one table

What is real: SkyServeController (its FastAPI app and /controller/load_balancer_sync
handler, served by its own uvicorn.run), RequestRateAutoscaler (with its
decision thread) and serve_state (sqlite under a temporary HOME). The load
balancer is started as sky/serve/service.py starts it: a spawn-mode
multiprocessing.Process running ux_utils.RedirectOutputForProcess(
load_balancer.run_load_balancer, load_balancer.log).run with the same six
arguments, positionally, where `load_balancer` is `from sky.serve import
load_balancer` (sluice's entry point through the sluice-skyserve import hook;
Sky's own with SLUICE_SKYSERVE_LB=0). The "workers2" variant starts
`sluice-proxy --controller-addr ... --workers 2` instead (the command-line way).

What is replaced: only the replica manager. FakeReplicaManager (a subclass of
Sky's ReplicaManager base class) answers get_active_replica_urls() with local
replica processes (tests/support/replica_app.py) instead of launching clusters, and
records scale_up/scale_down instead of acting. It is swapped in by assigning
replica_managers.SkyPilotReplicaManager before SkyServeController is built,
because SkyServeController.__init__ constructs that class by name.

Four phases at --rate requests/s, --phase-seconds each: 2 replicas; a third
added; the first removed (terminated 2 s after it leaves the set, as a
replica being torn down); one empty answer from the controller. Prints (or
writes as JSON) per phase: sent, 2xx, non-2xx, hung (> 10 s), plus sync
failures from the load balancer's log, the requests each replica served, and
the controller autoscaler's own request count and QPS.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import multiprocessing
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
HUNG_AFTER = 10.0
SERVICE = "bench-svc"
PHASES = ("2 replicas", "add one", "remove one", "one empty answer")
SYNC_FAIL = re.compile(r"sync with the Sky Serve controller failed|"
                       r"An error occurred when syncing with the controller")
# A sync written on a connection the controller had already closed (issue 14, item 1).
STALE_SYNC = re.compile(r"sync with the Sky Serve controller failed \((ClientOSError|"
                        r"ServerDisconnectedError|ClientConnectionResetError)")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def make_fake_replica_manager(base: type) -> type:
    class FakeReplicaManager(base):  # type: ignore[misc, valid-type]
        """A named fake: local replica URLs instead of SkyPilot clusters."""

        urls: list[str] = []  # set by the harness
        empty_answers = 0  # the next N calls answer no replica
        calls = 0
        scale_ups: list[Any] = []
        scale_downs: list[int] = []

        def scale_up(self, resources_override: Any = None) -> None:
            type(self).scale_ups.append(resources_override)

        def scale_down(self, replica_id: int, purge: bool = False) -> None:
            type(self).scale_downs.append(replica_id)

        def update_version(self, version: int, spec: Any, update_mode: Any) -> None:
            pass

        def get_active_replica_urls(self) -> list[str]:
            cls = type(self)
            cls.calls += 1
            if cls.empty_answers > 0:
                cls.empty_answers -= 1
                return []
            return list(cls.urls)

    return FakeReplicaManager


def replica_python() -> str:
    """tests/support/replica_app.py needs 3.11+; a 3.10 run borrows .venv-sky's interpreter."""
    if sys.version_info >= (3, 11):
        return sys.executable
    return str(ROOT / ".venv-sky" / "bin" / "python")


def start_replica(port: int, rid: str, log_dir: Path) -> subprocess.Popen[bytes]:
    with (log_dir / f"replica-{rid}.log").open("wb") as log:
        return subprocess.Popen(
            [replica_python(), "-m", "tests.support.replica_app", "--port", str(port), "--id", rid],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_http(url: str, timeout: float, ctx: ssl.SSLContext | None = None,
              want: int = 200) -> int:
    """Poll until `url` answers `want`; the number of HTTP answers it got (any status)."""
    deadline = time.monotonic() + timeout
    answers = 0
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                answers += 1
                if resp.status == want:
                    return answers
        except urllib.error.HTTPError:
            answers += 1
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer {want} within {timeout}s")
        time.sleep(0.1)


def replica_total(port: int) -> int:
    with urllib.request.urlopen(f"http://{HOST}:{port}/stats", timeout=2) as resp:
        return int(json.loads(resp.read())["total"])


async def phase_load(url: str, rate: float, seconds: float,
                     ctx: ssl.SSLContext | None) -> dict[str, int]:
    import aiohttp

    counts = {"sent": 0, "2xx": 0, "non-2xx": 0, "hung": 0}

    async def one(session: aiohttp.ClientSession) -> None:
        counts["sent"] += 1
        try:
            async with session.get(url, ssl=ctx if ctx is not None else True,
                                   timeout=aiohttp.ClientTimeout(total=HUNG_AFTER)) as resp:
                await resp.read()
                counts["2xx" if 200 <= resp.status < 300 else "non-2xx"] += 1
        except asyncio.TimeoutError:
            counts["hung"] += 1
        except aiohttp.ClientError:
            counts["non-2xx"] += 1

    tasks = []
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(session)))
        await asyncio.gather(*tasks)
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="sky-real-"))
    os.environ["HOME"] = str(work)  # serve_state's sqlite and ~/.sky live here
    if args.lb == "sky":
        os.environ["SLUICE_SKYSERVE_LB"] = "0"
    import sky
    from sky.serve import controller as controller_lib
    from sky.serve import load_balancer, replica_managers, serve_state, service_spec
    from sky.utils import ux_utils

    logs = work / "logs"
    logs.mkdir()
    spec_config: dict[str, Any] = {
        "readiness_probe": "/health",
        "replica_policy": {"min_replicas": 2, "max_replicas": 4,
                           "target_qps_per_replica": 100},
        "load_balancing_policy": "least_load",
    }
    ctx: ssl.SSLContext | None = None
    if args.tls:
        tls_dir = work / ".sky" / "serve" / SERVICE
        tls_dir.mkdir(parents=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(tls_dir / "tls_keyfile"),
                        "-out", str(tls_dir / "tls_certfile"), "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        spec_config["tls"] = {"keyfile": f"~/.sky/serve/{SERVICE}/tls_keyfile",
                              "certfile": f"~/.sky/serve/{SERVICE}/tls_certfile"}
        ctx = ssl.create_default_context(cafile=str(tls_dir / "tls_certfile"))
    spec = service_spec.SkyServiceSpec.from_yaml_config(spec_config)
    # The service's records, as sky/serve/service.py's _start() writes them.
    assert serve_state.add_service(
        SERVICE, controller_job_id=0, policy=spec.autoscaling_policy_str(),
        requested_resources_str="-", load_balancing_policy=spec.load_balancing_policy,
        status=serve_state.ServiceStatus.CONTROLLER_INIT,
        tls_encrypted=spec.tls_credential is not None, pool=False,
        controller_pid=os.getpid(), entrypoint="bench/skyserve_real.py")
    serve_state.add_or_update_version(
        SERVICE, 1, spec, json.dumps({"service": spec_config, "run": "replica_app"}))

    fake = make_fake_replica_manager(replica_managers.ReplicaManager)
    replica_managers.SkyPilotReplicaManager = fake  # type: ignore[misc]
    ports = [free_port() for _ in range(3)]
    replicas = [start_replica(p, f"r{i + 1}", logs) for i, p in enumerate(ports)]
    lb_proc: Any = None
    try:
        for p in ports:
            wait_http(f"http://{HOST}:{p}/health", 20)
        urls = [f"http://{HOST}:{p}" for p in ports]
        fake.urls = urls[:2]

        ctrl_port = free_port()
        controller = controller_lib.SkyServeController(SERVICE, spec, 1, HOST, ctrl_port)
        threading.Thread(target=controller.run, daemon=True).start()
        wait_http(f"http://{HOST}:{ctrl_port}/autoscaler/info", 30)
        controller_addr = f"http://{HOST}:{ctrl_port}"

        lb_port = free_port()
        lb_log = logs / "load_balancer.log"
        if args.lb == "workers2":
            with lb_log.open("wb") as out:
                lb_proc = subprocess.Popen(
                    [sys.executable, "-m", "proxy.cli", "--controller-addr", controller_addr,
                     "--load-balancer-port", str(lb_port), "--workers", "2",
                     "--admin-port", "-1"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        else:
            # Exactly as sky/serve/service.py starts it.
            multiprocessing.set_start_method("spawn", force=True)
            lb_proc = multiprocessing.Process(
                target=ux_utils.RedirectOutputForProcess(
                    load_balancer.run_load_balancer, str(lb_log)).run,
                args=(controller_addr, lb_port, spec.load_balancing_policy,
                      spec.tls_credential, spec.target_qps_per_replica,
                      spec.lb_stream_timeout_seconds))
            lb_proc.start()
        scheme = "https" if args.tls else "http"
        lb_url = f"{scheme}://{HOST}:{lb_port}"
        # Sky's LB answers 503 until its first sync (5 s); these requests count too.
        probes = wait_http(lb_url + "/fast", 60, ctx)

        before = [replica_total(p) for p in ports]
        results = []
        loop = asyncio.new_event_loop()
        try:
            for name in PHASES:
                if name == "add one":
                    fake.urls = urls[:3]
                elif name == "remove one":
                    fake.urls = urls[1:3]
                    threading.Timer(2.0, replicas[0].terminate).start()
                elif name == "one empty answer":
                    fake.empty_answers = 1
                counts = loop.run_until_complete(
                    phase_load(lb_url + "/fast", args.rate, args.phase_seconds, ctx))
                results.append({"phase": name, **counts})
            # Every request's timestamp reaches the autoscaler with the next syncs.
            autoscaler = controller._autoscaler
            sent = sum(r["sent"] for r in results) + probes
            deadline = time.monotonic() + 45
            while (len(autoscaler.request_timestamps) < sent
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            stamps = list(autoscaler.request_timestamps)
        finally:
            loop.close()
        served = [max(0, replica_total(p) - b) if i else None
                  for i, (p, b) in enumerate(zip(ports, before, strict=True))]
        log_text = lb_log.read_text(errors="replace")
        return {
            "lb": args.lb, "python": sys.version.split()[0], "skypilot": sky.__version__,
            "sluice_from": str(Path(importlib.import_module("proxy").__file__ or "").parent),
            # Which run_load_balancer service.py's `load_balancer` module hands out.
            "entry_point": load_balancer.run_load_balancer.__module__,
            "tls": args.tls, "phases": results,
            "sync_failures": len(SYNC_FAIL.findall(log_text)),
            "stale_connection_syncs": len(STALE_SYNC.findall(log_text)),
            "autoscaler_requests": len(stamps),
            "requests_sent": sent,  # the phases' and the readiness probes' requests
            "autoscaler_sorted": stamps == sorted(stamps),
            "autoscaler_qps": len(stamps) / autoscaler.qps_window_size,
            "autoscaler_window": autoscaler.qps_window_size,
            "empty_answer_served": fake.empty_answers == 0,
            "replica_served": {"r2": served[1], "r3": served[2]},
            "lb_log_has_sluice": "sluice-proxy listening" in log_text,
            "log_dir": str(logs),
        }
    finally:
        if lb_proc is not None:
            if isinstance(lb_proc, subprocess.Popen):
                lb_proc.send_signal(signal.SIGTERM)
                lb_proc.wait(15)
            else:
                lb_proc.terminate()
                lb_proc.join(15)
                if lb_proc.is_alive():
                    lb_proc.kill()
                    lb_proc.join(5)
        for r in replicas:
            if r.poll() is None:
                r.terminate()
            r.wait(10)


VARIANTS: list[tuple[str, str, list[str]]] = [
    ("sluice, 1 worker (in-process, run_load_balancer)", ".venv-sky", ["--lb", "sluice"]),
    ("sluice, 2 workers (sluice-proxy --workers 2)", ".venv-sky", ["--lb", "workers2"]),
    ("sluice, Python 3.10 (run_load_balancer)", ".venv-sky310", ["--lb", "sluice"]),
    ("sluice, TLS with ~ paths", ".venv-sky", ["--lb", "sluice", "--tls"]),
    ("Sky Serve 0.14.1's own LB", ".venv-sky", ["--lb", "sky"]),
]


def table(args: argparse.Namespace) -> None:
    rows = []
    for label, venv, extra in VARIANTS:
        python = ROOT / venv / "bin" / "python"
        if not python.exists():
            print(f"skip {label}: {python} missing", file=sys.stderr)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as out, \
                tempfile.NamedTemporaryFile(suffix=".log", delete=False) as log:
            print(f"running: {label} (controller output: {log.name})", file=sys.stderr)
            subprocess.run([str(python), __file__, *extra, "--rate", str(args.rate),
                            "--phase-seconds", str(args.phase_seconds), "--json", out.name],
                           cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
            rows.append((label, json.loads(Path(out.name).read_text())))
    print(f"\n{args.rate:g} req/s, {args.phase_seconds:g} s per phase; hung = no answer "
          f"in {HUNG_AFTER:g} s; sync failures from the LB's log\n")
    print(f"| {'load balancer':50} | {'phase':16} | sent | 2xx | non-2xx | hung "
          f"| sync failures |")
    print(f"|{'-' * 52}|{'-' * 18}|-----:|----:|--------:|-----:|--------------:|")
    for label, res in rows:
        for i, ph in enumerate(res["phases"]):
            fails = str(res["sync_failures"]) if i == 0 else ""
            print(f"| {label if i == 0 else '':50} | {ph['phase']:16} | {ph['sent']:4} "
                  f"| {ph['2xx']:3} | {ph['non-2xx']:7} | {ph['hung']:4} | {fails:>13} |")
    print()
    for label, res in rows:
        sent = res["requests_sent"]  # the phases' requests and the readiness probes'
        print(f"{label}: python {res['python']}, autoscaler saw {res['autoscaler_requests']} "
              f"of {sent} requests (sorted: {res['autoscaler_sorted']}, "
              f"QPS {res['autoscaler_qps']:.2f}), r3 served {res['replica_served']['r3']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lb", choices=["sluice", "workers2", "sky"], default="sluice")
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--phase-seconds", type=float, default=12.0)
    parser.add_argument("--json", help="write the result here (default: print it)")
    parser.add_argument("--table", action="store_true", help="run every variant; print a table")
    args = parser.parse_args()
    if args.table:
        table(args)
        return
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
