"""The state dir: where every file lives (`StateDir`), private files, and Redis URLs
with and without their password.

`StateDir` is the one place that names a path under the state dir; `sluice run`,
the CLI and the local backend ask it rather than joining names themselves.

Everything sluice writes under its state dir is for its own user only:
directories 0700, files 0600 (logs, run.json, handle files, the Redis password
and config). Modes are set explicitly (not left to the umask), also on a file
or sluice-owned directory that already existed with looser bits.

A Redis password never goes on a command line or into run.json: `sluice run`
keeps it in `{state_dir}/redis/password` (0600, in a 0700 directory), passes it
to its children in their environment, and the ops commands read it from there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from proxy import redisurl

DIR_MODE = 0o700
FILE_MODE = 0o600
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC

#: The state dir when none is given (`--state-dir`, env SLUICE_STATE_DIR).
DEFAULT_STATE_DIR = "~/.sluice"


@dataclass(frozen=True)
class StateDir:
    """Every path under a state dir `root`:

        run.json                          a live `sluice run` (run.RunInfo)
        controller.log                    the controller's output under `sluice run`
        redis/                            `sluice run`'s embedded redis-server
        redis/password                    the Redis password of a `sluice run` (0600)
        {service}/                        one service's files (0700)
          proxy.log                       `sluice run`'s proxy
          replica-{id}.log                a local replica's output
          replica-{id}.json               its handle file, from spawn to termination
          setup-v{version}.log            the setup of a version (local backend)
          setup-v{version}.json           its handle file while it runs
          setup-v{version}-{key}.done     marks that setup as done for that task
    """

    root: Path

    @property
    def run_info(self) -> Path:
        return self.root / "run.json"

    @property
    def controller_log(self) -> Path:
        return self.root / "controller.log"

    @property
    def redis_dir(self) -> Path:
        return self.root / "redis"

    @property
    def redis_password(self) -> Path:
        return self.redis_dir / "password"

    def service_dir(self, service: str) -> Path:
        return self.root / service

    def proxy_log(self, service: str) -> Path:
        return self.service_dir(service) / "proxy.log"

    def replica_log(self, service: str, replica_id: int) -> Path:
        return self.service_dir(service) / f"replica-{replica_id}.log"

    def replica_handle(self, service: str, replica_id: int) -> Path:
        return handle_file_of(self.replica_log(service, replica_id))

    def setup_log(self, service: str, version: int) -> Path:
        return self.service_dir(service) / f"setup-v{version}.log"

    def setup_handle(self, service: str, version: int) -> Path:
        return handle_file_of(self.setup_log(service, version))

    def setup_marker(self, service: str, version: int, key: str) -> Path:
        return self.service_dir(service) / f"setup-v{version}-{key}.done"

    def handle_files(self, service: str) -> list[Path]:
        """The handle files of `service`'s replicas and running setups, sorted."""
        directory = self.service_dir(service)
        return sorted([*directory.glob("replica-*.json"), *directory.glob("setup-v*.json")])


def handle_file_of(log_path: Path) -> Path:
    """The handle file next to a replica's or setup's log (a handle records its log)."""
    return log_path.with_suffix(".json")


def private_dir(path: Path, *, enforce: bool = True) -> Path:
    """Create `path` (and parents) with mode 0700; with `enforce`, also tighten a directory
    that already exists (only for directories sluice owns, never a user's --state-dir)."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if enforce and (path.stat().st_mode & 0o777) != DIR_MODE:
        path.chmod(DIR_MODE)
    return path


def open_private_append(path: Path) -> int:
    """A file descriptor appending to `path`, created 0600 (an older file is made 0600)."""
    fd = os.open(path, _APPEND, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` atomically with `data`, mode 0600 from the first byte."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE)  # fmt: skip
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    tmp.replace(path)


def read_secret(path: Path) -> str:
    """The secret in `path` (one line; surrounding whitespace dropped)."""
    return path.read_text().strip()


def split_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None). The user name stays."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    user, _, host = parts.netloc.rpartition("@")
    user = user.partition(":")[0]
    return _rebuild(url, f"{user}@{host}" if user else host), unquote(parts.password)


def with_password(url: str, password: str) -> str:
    """`url` with `password` (replacing any it had); works for redis://, rediss://, unix://."""
    bare, _ = split_password(url)
    user, at, host = urlsplit(bare).netloc.rpartition("@")
    return _rebuild(bare, f"{user if at else ''}:{quote(password, safe='')}@{host}")


def _rebuild(url: str, netloc: str) -> str:
    """`url` with its netloc (the part between `//` and the path) replaced."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a URL: {redact_url(url)}")
    old = urlsplit(url).netloc
    return f"{scheme}://{netloc}{rest[len(old):]}"


def redact_url(url: str) -> str:
    """The URL with `***` for its passwords (for messages and logs), incl. a sentinel
    URL's `sentinel_password`."""
    return redisurl.redact(url)
