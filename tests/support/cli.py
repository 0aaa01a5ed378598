"""Running the `sluice` CLI in-process (click's CliRunner) and reading what it left in Redis.

- `sluice(*args, env=None)`: invoke the CLI; SLUICE_REDIS_URL and SLUICE_REDIS_CA_FILE
  are blanked unless `env` sets them, so the host's environment never leaks in;
  unexpected exceptions propagate (a traceback is a failure, not an exit code).
- `one_line_error(result, *needles)`: assert exit 1 with exactly one "Error: ..." line
  on stderr, no traceback, containing each needle; returns the line.
- `redis_keys(url, prefix)`: every key under `prefix:` on the Redis at `url`.
"""

from __future__ import annotations

import redis
from click.testing import CliRunner, Result

from controlplane.cli import cli

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
