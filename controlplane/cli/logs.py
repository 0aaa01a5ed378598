"""`sluice logs`: the controller's, the proxy's and replicas' logs, printed or followed.

Logs live under the state dir (`controlplane.statedir.StateDir`); a replica's path
is the one in its handle. A replica on SkyPilot has its log streamed by SkyPilot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from controlplane.cli.common import (
    Target,
    checked_name,
    errors,
    redis_options,
    resolve_state_dir,
    target_of,
    with_store,
)
from controlplane.records import Handle, ReplicaRecord
from controlplane.statedir import StateDir
from controlplane.store import ServiceNotFound, Store

_FOLLOW_POLL = 0.25  # seconds between looks at a followed log file


@click.command()
@click.argument("name")
@click.argument("replica_ids", metavar="[ID]...", nargs=-1, type=click.IntRange(1))
@click.option("--controller", is_flag=True, help="The controller's log.")
@click.option("--load-balancer", "--proxy", "load_balancer", is_flag=True,
              help="The load balancer's log: the proxy of `sluice run`.")  # fmt: skip
@click.option("--replica", "replica_opts", type=click.IntRange(1), metavar="ID",
              multiple=True, help="A replica's log (the same as ID; repeatable).")  # fmt: skip
@click.option("-f/", "--follow/--no-follow", default=True,
              help="Keep printing what is appended until Ctrl-C (the default), or print the "
              "log so far and exit.  [default: follow]")  # fmt: skip
@click.option(
    "--tail",
    type=click.IntRange(0),
    metavar="N",
    help="Only the last N lines; then exit unless --follow is given.",
)
@redis_options()
def logs(
    name: str,
    replica_ids: tuple[int, ...],
    controller: bool,
    load_balancer: bool,
    replica_opts: tuple[int, ...],
    follow: bool,
    tail: int | None,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Print logs of service NAME: --controller, --load-balancer, or replica IDs; with
    none of them, every log of NAME (controller, load balancer, setups, replicas).

    Logs live under --state-dir: controller.log, NAME/proxy.log and, for replicas
    of the local backend, the path in the replica's handle (NAME/replica-ID.log).
    Several logs are printed one after another, each under a `==> path <==` line,
    and followed together.

    \b
    Examples:
      sluice logs echo
      sluice logs echo 1
      sluice logs echo --controller --no-follow
      sluice logs echo --load-balancer --tail 100
      sluice logs echo 1 2 --no-follow
    """
    ctx = click.get_current_context()
    if (
        tail is not None
        and ctx.get_parameter_source("follow") is click.core.ParameterSource.DEFAULT
    ):
        follow = False  # as `sky serve logs --tail N`: the last lines, then exit
    layout = StateDir(resolve_state_dir(state_dir))
    name = checked_name(name)
    paths: list[Path] = []
    if controller:
        paths.append(layout.controller_log)
    if load_balancer:
        paths.append(layout.proxy_log(name))
    ids = list(dict.fromkeys([*replica_ids, *replica_opts]))
    if ids:
        target = target_of(redis_url, prefix, state_dir)
        paths += _replica_logs(target, layout, name, ids, others=bool(paths), follow=follow)
    if not paths:
        # No target: every log of the service, followed together (what `sky serve logs
        # --sync-down` gathers by default; Sky's tail asks for a target instead).
        paths = _all_logs(layout, name)
        if not paths:
            raise click.ClickException(
                f"no logs of {name} under {layout.root}; give --state-dir of its run, or "
                "choose one: --controller, --load-balancer, or replica IDs"
            )
    for path in paths:
        if not path.is_file():
            raise click.ClickException(f"no log at {path}")
    with contextlib.suppress(KeyboardInterrupt):
        _print_files(paths, follow=follow, tail=tail)


def _all_logs(layout: StateDir, name: str) -> list[Path]:
    """The controller's log, the service's proxy log, its replicas' and setups' logs
    (by replica id), those that exist."""
    directory = layout.service_dir(name)

    def replica_id(path: Path) -> int:
        return int(digits) if (digits := path.stem.removeprefix("replica-")).isdigit() else 0

    found = [layout.controller_log, layout.proxy_log(name),
             *sorted(directory.glob("setup-v*.log")),
             *sorted(directory.glob("replica-*.log"), key=replica_id)]  # fmt: skip
    return [path for path in found if path.is_file()]


def _replica_logs(
    target: Target, layout: StateDir, name: str, ids: list[int], *, others: bool, follow: bool
) -> list[Path]:
    """The log paths of replicas `ids`; a replica on SkyPilot has its log streamed here
    instead, alone (`others`: other logs were asked for too), and the command exits."""
    paths: list[Path] = []
    for replica_id in ids:
        cluster = _skypilot_handle(target, name, replica_id)
        if cluster is not None:
            # SkyPilot streams a cluster's job log itself: one log per command.
            if len(ids) > 1 or others:
                raise click.UsageError(
                    f"replica {replica_id} runs on SkyPilot: show its log on its own "
                    f"(sluice logs {name} {replica_id})"
                )
            code = 0
            with errors(target.url), contextlib.suppress(KeyboardInterrupt):
                code = _skypilot_logs(cluster, follow)
            sys.exit(code)
        paths.append(_replica_log(target, layout, name, replica_id))
    return paths


def _skypilot_handle(target: Target, name: str, replica_id: int) -> Handle | None:
    """The handle of replica `replica_id` when it runs on SkyPilot, else None."""

    async def lookup(store: Store) -> ReplicaRecord | None:
        return await store.replica(name, replica_id)

    with contextlib.suppress(click.ClickException):
        record = with_store(target, lookup)
        if record is not None and record.backend == "skypilot":
            return record.handle
    return None


def _skypilot_logs(handle: Handle, follow: bool) -> int:
    """Stream the replica cluster's job log with SkyPilot's SDK (`sky.tail_logs`)."""
    from controlplane.backends.skypilot import stream_logs
    from controlplane.backends.skypilot_sdk import SkyPilotClient

    async def main() -> int:
        sdk = SkyPilotClient()
        try:
            return await stream_logs(sdk, handle, follow=follow, out=sys.stdout)
        finally:
            await sdk.aclose()

    return asyncio.run(main())


def _replica_log(target: Target, layout: StateDir, name: str, replica_id: int) -> Path:
    """The log path in the replica's handle; the local backend's default path when the
    record is gone (a terminated replica) or Redis cannot say."""
    fallback = layout.replica_log(name, replica_id)

    async def lookup(store: Store) -> ReplicaRecord | None:
        record = await store.replica(name, replica_id)
        if record is None and await store.service(name) is None:
            raise ServiceNotFound(f"no service {name!r}")
        return record

    try:
        record = with_store(target, lookup)
    except click.ClickException:
        if fallback.is_file():
            return fallback
        raise
    if record is not None:
        logged = record.handle.get("log")
        if isinstance(logged, str):
            return Path(logged)
        if record.backend != "local":
            raise click.ClickException(
                f"replica {replica_id} of {name} is {record.backend}; sluice keeps no log of it"
            )
    elif not fallback.is_file():
        raise click.ClickException(f"service {name!r} has no replica {replica_id}")
    return fallback


def _print_files(paths: list[Path], *, follow: bool, tail: int | None) -> None:
    """Copy the files to stdout (the last `tail` lines of each); with `follow`, keep
    copying what is appended to any of them (tail -F), a `==> path <==` line before
    each change of file when there are several."""
    out = sys.stdout.buffer  # click.get_binary_stream is deprecated since click 8.5
    with contextlib.ExitStack() as stack:
        files = [(path, stack.enter_context(path.open("rb"))) for path in paths]
        shown: Path | None = None
        for path, fh in files:
            if tail is not None:
                _seek_last_lines(fh, tail)
            while chunk := fh.read(65536):
                if len(paths) > 1 and shown != path:
                    out.write(f"{chr(10) if shown else ''}==> {path} <==\n".encode())
                    shown = path
                out.write(chunk)
        out.flush()
        while follow:
            idle = True
            for path, fh in files:
                with contextlib.suppress(OSError):
                    if path.stat().st_size < fh.tell():
                        fh.seek(0)  # truncated: start over
                chunk = fh.read(65536)
                if chunk:
                    idle = False
                    if len(paths) > 1 and shown != path:
                        out.write(f"\n==> {path} <==\n".encode())
                        shown = path
                    out.write(chunk)
            out.flush()
            if idle:
                time.sleep(_FOLLOW_POLL)  # a file has no change notification without inotify


def _seek_last_lines(fh: Any, lines: int) -> None:
    """Position `fh` at the start of its last `lines` lines (a final newline ends a line)."""
    end = fh.seek(0, os.SEEK_END)
    if lines == 0:
        return
    pos, found, block = end, 0, 65536
    while pos > 0:
        step = min(block, pos)
        pos -= step
        fh.seek(pos)
        data = fh.read(step)
        if pos + step == end and data.endswith(b"\n"):
            data = data[:-1]  # the newline that ends the last line starts nothing
        for i in range(len(data) - 1, -1, -1):
            if data[i] == 10:
                found += 1
                if found == lines:
                    fh.seek(pos + i + 1)
                    return
    fh.seek(0)
