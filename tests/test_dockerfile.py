"""The Dockerfile, checked without a Docker engine: every file it copies exists in the
repo and is not excluded by .dockerignore, every command it runs is a console script of
the package, the build args keep their defaults, and hadolint (when installed) finds
nothing. tests/image/test_image.sh builds and runs the image for real."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support.processes import REPO as ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    joined = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.strip().upper().startswith(name + " ")]


def _copied_sources() -> list[str]:
    """Context paths the COPY instructions read (`${VAR:-default}` resolved to its default)."""
    sources = []
    for args in _instructions("COPY"):
        if args.startswith("--from="):
            continue  # from a build stage, not the context
        *srcs, _dest = args.split()
        sources += [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", src) for src in srcs]
    return sources


def test_every_copied_path_exists() -> None:
    sources = _copied_sources()
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repo"


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ".venv*" in patterns and ".git" in patterns  # the context stays small
    for src in _copied_sources():
        parts = Path(src).parts
        for pattern in patterns:
            for i in range(1, len(parts) + 1):
                prefix = "/".join(parts[:i])
                assert not fnmatch.fnmatch(prefix, pattern), (
                    f"Dockerfile copies {src}, but .dockerignore excludes it ({pattern})")


def test_build_args_default_to_slim_python_and_online_install() -> None:
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim$", DOCKERFILE, re.M)
    assert re.search(r'^ARG WHEELHOUSE=""$', DOCKERFILE, re.M)
    assert all(line.split()[0] == "${BASE_IMAGE}" for line in _instructions("FROM"))
    install = _instructions("RUN")[0]
    # Both branches install the pinned versions; only the wheelhouse one is offline.
    assert install.count("-c requirements/ci.txt") == 2
    assert "--no-index --find-links /wheelhouse" in install


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
    health = _instructions("HEALTHCHECK")[0]
    assert "/healthz" in health and "SLUICE_PROXY_ADMIN_PORT" in health
    assert "SLUICE_PROXY_ADMIN_PORT=9090" in _instructions("ENV")[-1]
    user = _instructions("USER")[-1].strip()
    assert user not in ("root", "0")


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint_clean() -> None:
    result = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_script_parses() -> None:
    script = ROOT / "tests" / "image" / "test_image.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_image_script_shellcheck_clean() -> None:
    scripts = [ROOT / "tests" / "image" / "test_image.sh", ROOT / ".ci" / "run"]
    result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
