"""Passwords never printed (issue 24, item 9): a password with `/` or `?` (base64 ones
have `/`) must not be taken for the path or the query, by `redact()` nor by the error
messages of the real CLIs (`sluice-proxy` as a process, `sluice` through click)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxy.redisurl import RedisURLError, redact, validate
from tests.support.cli import sluice
from tests.support.processes import REPO

# The example: a base64 password, and its pieces redis-py would quote back.
PASSWORD = "Zm9v/YmFy+cGFzcw=="
PIECES = ("Zm9v", "YmFy", "cGFzcw")
URLS = [
    f"redis://:{PASSWORD}@127.0.0.1:6379/0",
    f"redis://user:{PASSWORD}@127.0.0.1:6379/0",
    "redis://:Zm9v?YmFy+cGFzcw==@127.0.0.1:6379/0",
    "redis://:Zm9v#YmFy+cGFzcw==@127.0.0.1:6379/0",
    f"rediss://{PASSWORD}@127.0.0.1:6379/0",
    f"redis+sentinel://:{PASSWORD}@127.0.0.1:26379/svc/0?sentinel_password=YmFy/cGFzcw",
]


def _clean(text: str) -> None:
    for piece in PIECES:
        assert piece not in text, text


@pytest.mark.parametrize("url", URLS)
def test_redact_hides_passwords_with_slashes_and_question_marks(url: str) -> None:
    text = redact(url)
    _clean(text)
    assert "127.0.0.1:" in text and "***" in text


def test_redact_keeps_what_is_not_secret() -> None:
    assert redact(f"redis://u:{PASSWORD}@h:1/2") == "redis://u:***@h:1/2"
    assert redact("rediss://h:1/0?ssl_certfile=/c.pem") == "rediss://h:1/0?ssl_certfile=%2Fc.pem"


@pytest.mark.parametrize("url", URLS)
def test_validate_refuses_such_a_url_without_quoting_the_password(url: str) -> None:
    with pytest.raises(RedisURLError) as info:
        validate(url)
    _clean(str(info.value))
    assert "percent-encode" in str(info.value)
    assert info.value.__cause__ is None


def test_sluice_proxy_prints_no_piece_of_the_password() -> None:
    env = {**os.environ, "SLUICE_REDIS_URL": URLS[0]}
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "--service", "x"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0
    _clean(out.stdout + out.stderr)
    assert "percent-encode" in out.stderr


@pytest.mark.parametrize("url", URLS[:3])
def test_sluice_cli_prints_no_piece_of_the_password(url: str) -> None:
    result = sluice("status", env={"SLUICE_REDIS_URL": url})
    assert result.exit_code != 0
    _clean(result.output)
