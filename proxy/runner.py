"""Running the proxy: one process (`run_proxy`), or N worker processes on one port
(`run_workers`, with the Supervisor that keeps them running). uvloop is chosen here
and only here.

One process runs a ProxyApp until SIGTERM/SIGINT; its shutdown is bounded
(ProxyApp.aclose), and a watchdog thread armed at the signal ends the process
shortly after that bound in any case.

`--workers N`: each worker is `python -m proxy.cli ARGS --worker-index I`, where ARGS are the
options this command was given (not `sys.argv`, which for `sluice proxy` starts
with the subcommand), so both entry points re-execute the same way. Workers
share the port with SO_REUSEPORT; worker I serves admin on admin port + I.

Restarts: a worker that dies is started again after a capped exponential
backoff (`RestartPolicy.delay`). A worker that dies within `min_uptime` of its
start counts as failing to start; after `max_quick_deaths` of those in a row the
supervisor gives up: one error line, the other workers are stopped, exit 1. A
worker that ran longer than `min_uptime` starts its count afresh.

Stopping: SIGTERM/SIGINT is forwarded to every worker; a worker still alive
`shutdown_grace + KILL_AFTER` seconds later is SIGKILLed, so the supervisor
always ends within that bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy import compat, limits, parent
from proxy.app import CLOSE_BOUND, ProxyApp
from proxy.config import ProxyConfig

log = logging.getLogger("sluice.proxy")

# A process still shutting down this long after grace + CLOSE_BOUND exits anyway.
WATCHDOG_SLACK = 0.5


def _exit_now(seconds: float) -> None:
    # From the watchdog thread: no logging (its lock may be held by the stuck loop).
    os.write(2, b"sluice-proxy: shutdown still not finished %.1fs after the signal; "
                b"exiting now\n" % seconds)
    os._exit(1)


def run_proxy(config: ProxyConfig) -> None:
    """Run one proxy process until SIGTERM/SIGINT, on uvloop.

    Shutdown ends within `shutdown_grace + CLOSE_BOUND` (ProxyApp.aclose bounds
    every step); a watchdog thread armed at the signal ends the process shortly
    after that in any case, e.g. if a task ignores cancellation when the loop
    is torn down.
    """
    import uvloop

    watchdog: threading.Timer | None = None
    limits.raise_nofile()
    # A --workers worker (the supervisor never runs this): it ends with its supervisor.
    supervisor = os.getppid() if config.workers > 1 else None
    if supervisor is not None:
        parent.die_with_parent()

    async def serve() -> None:
        nonlocal watchdog
        app = ProxyApp(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch = (loop.create_task(parent.watch_parent(supervisor, stop.set))
                 if supervisor is not None else None)
        await app.start()
        try:
            await stop.wait()
            log.info("shutting down: draining in-flight requests (grace %.0fs)",
                     config.shutdown_grace)
        finally:
            if watch is not None:
                watch.cancel()
            limit = config.shutdown_grace + CLOSE_BOUND + WATCHDOG_SLACK
            watchdog = threading.Timer(limit, _exit_now, (limit,))
            watchdog.daemon = True
            watchdog.start()
            await app.aclose()

    try:
        compat.run(serve(), loop_factory=uvloop.new_event_loop)
    finally:
        if watchdog is not None:
            watchdog.cancel()


def run_workers(config: ProxyConfig, args: Sequence[str]) -> int:
    """Run `config.workers` worker processes, each `python -m proxy.cli ARGS --worker-index I`,
    until a signal stops them; the exit status for this process."""
    args = list(args)
    relay_dir = None
    if config.controller_addr:
        # Drop-in mode: worker 0 alone syncs with the controller; the others relay
        # through a private unix socket (proxy/sources/skyserve.py).
        relay_dir = tempfile.mkdtemp(prefix="sluice-sync-")
        args = [*args, "--sync-relay", os.path.join(relay_dir, "relay.sock")]
    try:
        return Supervisor(config.workers, args, shutdown_grace=config.shutdown_grace).run()
    finally:
        if relay_dir is not None:
            shutil.rmtree(relay_dir, ignore_errors=True)

# Seconds past the shutdown grace before a worker is SIGKILLed: a worker ends by
# itself within grace + CLOSE_BOUND (+ its watchdog's slack); this is the backstop.
KILL_AFTER = CLOSE_BOUND + 1.0
POLL = 0.05


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    backoff_initial: float = 0.5
    backoff_max: float = 10.0
    min_uptime: float = 10.0  # dying sooner than this after start = failing to start
    max_quick_deaths: int = 5  # in a row, per worker; then give up

    def delay(self, quick_deaths: int) -> float:
        """Seconds before restarting a worker that has died `quick_deaths` times in a row."""
        exponent = max(0, min(quick_deaths - 1, 30))
        return min(self.backoff_max, self.backoff_initial * 2.0**exponent)


def worker_argv(args: Sequence[str], index: int) -> list[str]:
    """The command line of worker `index`, given the options the supervisor was started with."""
    return [sys.executable, "-m", "proxy.cli", *args, "--worker-index", str(index)]


class Supervisor:
    """Runs `n` workers until a signal stops them or one keeps failing to start."""

    def __init__(
        self,
        n: int,
        args: Sequence[str],
        *,
        shutdown_grace: float,
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._n = n
        self._args = list(args)
        self._grace = shutdown_grace
        self._policy = policy or RestartPolicy()
        self._clock = clock
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._started: dict[int, float] = {}
        self._quick: dict[int, int] = {}  # consecutive quick deaths per worker
        self._restart_at: dict[int, float] = {}  # worker -> when to start it again
        self._stop_signal: int | None = None

    def _spawn(self, i: int) -> None:
        self._procs[i] = subprocess.Popen(worker_argv(self._args, i))
        self._started[i] = self._clock()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop_signal = signum
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        """Start the workers and supervise them; the process exit status."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for i in range(self._n):
            self._spawn(i)
        while self._stop_signal is None:
            now = self._clock()
            for i, proc in list(self._procs.items()):
                code = proc.poll()
                if code is None or i in self._restart_at:
                    continue
                if self._worker_died(i, code, now):
                    self._stop_all(signal.SIGTERM)
                    return 1
            for i, at in list(self._restart_at.items()):
                if now >= at and self._stop_signal is None:
                    del self._restart_at[i]
                    self._spawn(i)
            time.sleep(POLL)
        # Again: a worker started just as the signal came may have missed it.
        self._stop_all(self._stop_signal)
        return 0

    def _worker_died(self, i: int, code: int, now: float) -> bool:
        """Schedule worker i's restart; True when it keeps failing to start (give up)."""
        policy = self._policy
        uptime = now - self._started[i]
        quick = self._quick.get(i, 0) + 1 if uptime < policy.min_uptime else 1
        self._quick[i] = quick
        if uptime < policy.min_uptime and quick >= policy.max_quick_deaths:
            log.error("worker %d exited with %s %d times in a row within %.0fs of starting; "
                      "giving up (see its errors above)", i, code, quick, policy.min_uptime)
            return True
        delay = policy.delay(quick)
        log.error("worker %d exited with %s after %.1fs; restarting it in %.1fs",
                  i, code, uptime, delay)
        self._restart_at[i] = now + delay
        return False

    def _stop_all(self, signum: int) -> None:
        """Signal the live workers, SIGKILL any still alive after the grace plus
        KILL_AFTER, and reap them all."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)
        deadline = self._clock() + self._grace + KILL_AFTER
        for i, proc in self._procs.items():
            try:
                proc.wait(max(0.0, deadline - self._clock()))
            except subprocess.TimeoutExpired:
                log.error("worker %d still running %.0fs after the stop signal; killing it",
                          i, self._grace + KILL_AFTER)
                proc.kill()
                proc.wait()
