"""The Dockerfile, checked without a Docker engine (none runs here): every file it
copies exists in the repo, every command it runs is a console script of the package,
and hadolint (when installed) finds nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    joined = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.strip().upper().startswith(name + " ")]


def test_every_copied_path_exists() -> None:
    copies = _instructions("COPY")
    assert copies
    for args in copies:
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repo"


def test_commands_are_console_scripts() -> None:
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    assert {"sluice", "sluice-proxy"} <= scripts
    cmd = _instructions("CMD")[-1]
    assert re.findall(r'"([^"]+)"', cmd)[0] in scripts
    for line in DOCKERFILE.splitlines():
        for tool in re.findall(r"docker run .*? sluice (sluice[\w-]*)", line):
            assert tool in scripts


def test_exposes_proxy_and_admin_ports_and_runs_unprivileged() -> None:
    assert set(_instructions("EXPOSE")[0].split()) == {"8080", "9090"}
    assert "9090/healthz" in _instructions("HEALTHCHECK")[0]
    user = _instructions("USER")[-1].strip()
    assert user not in ("root", "0")


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint_clean() -> None:
    result = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
