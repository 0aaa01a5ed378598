"""Running the `sluice` CLI in-process (click's CliRunner) and reading what it left in Redis.

- `sluice(*args, env=None)`: invoke the CLI; SLUICE_REDIS_URL and SLUICE_REDIS_CA_FILE
  are blanked unless `env` sets them, so the host's environment never leaks in;
  unexpected exceptions propagate (a traceback is a failure, not an exit code).
- `one_line_error(result, *needles)`: assert exit 1 with exactly one "Error: ..." line
  on stderr, no traceback, containing each needle; returns the line.
- `redis_keys(url, prefix)`: every key under `prefix:` on the Redis at `url`.
- `store_call(url, prefix, fn)`: `await fn(store)` on a Store of its own, from a sync
  test (what the CLI would find, or a record as the controller would write it).
- `spawn_sluice(argv, log, env)` / `with sluice_child(...)`: ``python -m
  controlplane.cli`` as a child process of the test (the latter kills it and whatever
  it started when the block ends); `wait_exit(proc, log, within)`: its exit code after
  a SIGINT, the test failed with its log if it outlives `within` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import redis
from click.testing import CliRunner, Result

from controlplane.cli import cli
from controlplane.store import Store
from tests.support.pids import descendants, kill_all
from tests.support.processes import REPO

T = TypeVar("T")

_BLANK = {"SLUICE_REDIS_URL": "", "SLUICE_REDIS_CA_FILE": ""}


def sluice(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env={**_BLANK, **(env or {})},
                              catch_exceptions=False)  # fmt: skip


def one_line_error(result: Result, *needles: str) -> str:
    """Exit 1, exactly one line on stderr ("Error: ..."), no traceback; returns the line."""
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def redis_keys(url: str, prefix: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()


def store_call(url: str, prefix: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    """Run `fn(store)` to completion in a loop of its own (for sync tests)."""

    async def main() -> T:
        async with Store.from_url(url, prefix=prefix) as store:
            return await fn(store)

    return asyncio.run(main())


def spawn_sluice(
    argv: Sequence[str], log: Path, env: Mapping[str, str | None] | None = None
) -> subprocess.Popen[bytes]:
    """`python -m controlplane.cli *argv` from this checkout, its output in `log`. Its
    environment: this one, unbuffered, with this checkout on PYTHONPATH, then `env`
    (a None value removes that variable)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", *argv], cwd=REPO, env=full_env,
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


@contextlib.contextmanager
def sluice_child(
    argv: Sequence[str], log: Path, env: Mapping[str, str | None] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`spawn_sluice` for the length of a block; on the way out, it and whatever it
    started are SIGKILLed (if it still runs) and it is reaped."""
    proc = spawn_sluice(argv, log, env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_all([proc.pid, *descendants(proc.pid)])
        proc.wait(10)


def wait_exit(proc: subprocess.Popen[bytes], log: Path, within: float) -> int:
    """`proc`'s exit code, waiting up to `within` s (after its SIGINT); fails the test
    with its log if it still runs."""
    try:
        return proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"sluice run still running {within}s after SIGINT:\n{log.read_text()}")
