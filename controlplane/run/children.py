"""The controller and the proxy of one `sluice run`, as child processes.

Each runs `python -m ...` in its own session (a terminal Ctrl-C reaches only
`sluice run`, which stops them in order), gets SIGTERM if `sluice run` dies
(PR_SET_PDEATHSIG), and writes to its 0600 log under the state dir. The Redis URL
(with its password) and the CA file go in their environment, never in argv.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from controlplane import processes
from controlplane.run.config import RunConfig, RunError, tls_files
from controlplane.statedir import StateDir, open_private_append, private_dir

log = logging.getLogger("sluice.run")

#: The directory that holds the `controlplane` and `proxy` packages.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


class Children:
    """The child processes of a `sluice run` by role ("controller", "proxy"), and their
    logs. `on_spawn(role, pid)` is told of each child started."""

    def __init__(self, config: RunConfig, on_spawn: Callable[[str, int], None]) -> None:
        self._config = config
        self._layout = StateDir(config.state_dir)
        self._on_spawn = on_spawn
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def log_path(self, role: str) -> Path:
        if role == "controller":
            return self._layout.controller_log
        return self._layout.proxy_log(self._config.name)

    def alive(self, role: str) -> bool:
        """True while the child `role` was started and has not exited."""
        proc = self._procs.get(role)
        return proc is not None and proc.poll() is None

    def check(self) -> None:
        """Raise RunError naming the first child that exited, with its log's last line."""
        for role, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                raise RunError(
                    f"the {role} exited with code {code}: {_last_line(self.log_path(role))} "
                    f"(log: {self.log_path(role)})"
                )

    # -- starting ----------------------------------------------------------------------------

    def spawn_controller(self, url: str, *, terminate_on_exit: bool) -> None:
        config = self._config
        argv = ["-m", "controlplane.cli", "controller", "--prefix", config.prefix,
                "--state-dir", str(config.state_dir),
                "--drain-seconds", f"{config.drain_seconds:g}",
                "--log-level", config.log_level, "--backend", config.backend]  # fmt: skip
        if terminate_on_exit:
            argv.append("--terminate-on-exit")
        self._spawn("controller", argv, url)

    def spawn_proxy(self, url: str, port: int, admin_port: int) -> None:
        config = self._config
        service = config.spec.service
        argv = ["-m", "proxy.cli", "--redis-prefix", config.prefix,
                "--service", config.name, "--host", config.host, "--port", str(port),
                "--admin-port", str(admin_port), "--shutdown-grace", f"{config.stop_timeout / 2:g}",
                "--stream-idle-timeout", f"{service.load_balancer.stream_timeout_seconds:g}",
                "--log-level", config.log_level]  # fmt: skip
        tls = tls_files(config.spec)
        if tls is not None:
            argv += ["--tls-certfile", str(tls[0]), "--tls-keyfile", str(tls[1])]
        self._spawn("proxy", argv, url)

    def _spawn(self, role: str, argv: list[str], url: str) -> None:
        log_path = self.log_path(role)
        if log_path.parent != self._config.state_dir:
            private_dir(log_path.parent)
        out = os.fdopen(open_private_append(log_path), "ab")
        self._logs.append(out)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The URL (with its password) and the CA file go in the environment: argv is
        # world-readable (ps, /proc/PID/cmdline), the environment is not.
        env["SLUICE_REDIS_URL"] = url
        env.pop("SLUICE_REDIS_CA_FILE", None)
        if self._config.redis_ca_file is not None:
            env["SLUICE_REDIS_CA_FILE"] = self._config.redis_ca_file
        # The children import this package: make it importable without an install too.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SOURCE_ROOT, env.get("PYTHONPATH")) if p)
        self._procs[role] = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a terminal Ctrl-C reaches us only; we stop them in order
            preexec_fn=processes.die_with_parent_hook(),
        )
        self._on_spawn(role, self._procs[role].pid)

    # -- stopping ----------------------------------------------------------------------------

    async def stop(self, role: str, *, hurry: bool, say: Callable[[str], None]) -> None:
        """SIGTERM the child, SIGKILL it after the stop timeout (0.5 s when in a hurry)."""
        proc = self._procs.get(role)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        timeout = 0.5 if hurry else self._config.stop_timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, timeout)
        if proc.poll() is None:
            say(f"sluice: the {role} ignored SIGTERM; killing it")
            proc.kill()
            proc.wait()

    def stop_sync(self, role: str) -> None:
        """`stop`, blocking: for the last-resort cleanup outside the event loop."""
        proc = self._procs.get(role)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self._config.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s pid %d ignored SIGTERM; killing it", role, proc.pid)
                proc.kill()
                proc.wait()

    def close_logs(self) -> None:
        for fh in self._logs:
            fh.close()


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            lines = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return lines[-1].strip() if lines else "no output"
