"""`sluice snapshot`: the ReadySnapshot proxies route a service by, once or followed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import click
import msgspec

from controlplane.cli.common import errors, redis_options, target_of, with_store
from controlplane.display import snapshot_text
from controlplane.store import ServiceNotFound, Store, StoreError


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON (one line "
              "per generation with --watch).")  # fmt: skip
@click.option("--watch", is_flag=True, help="Keep printing every new generation; Ctrl-C stops.")
@redis_options()
def snapshot(
    name: str,
    as_json: bool,
    watch: bool,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Print the ReadySnapshot proxies route NAME by: generation, status, policy, active
    versions and ready replicas.

    \b
    Examples:
      sluice snapshot echo
      sluice snapshot echo --watch --json
      redis-cli GET sluice:svc:echo:snapshot     # the same, without sluice
    """
    target = target_of(redis_url, prefix, state_dir)

    def show(snap: Any) -> None:
        if as_json:
            click.echo(msgspec.json.encode(snap).decode())
        else:
            click.echo(snapshot_text(snap, time.time()))

    async def current(store: Store) -> Any:
        snap = await store.snapshot(name)
        if snap is None:
            if await store.service(name) is None:
                raise ServiceNotFound(f"no service {name!r}")
            raise StoreError(f"service {name!r} has no snapshot yet")
        return snap

    if not watch:
        show(with_store(target, current))
        return
    with_store(target, current)  # a missing service is an error, not an endless wait

    async def follow() -> None:
        first = True
        async with Store.from_url(target.url, prefix=target.prefix,
                                  ca_file=target.ca_file) as store:  # fmt: skip
            async for snap in store.follow_snapshots(name):
                if not first and not as_json:
                    click.echo("")
                first = False
                show(snap)

    with errors(target.url), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follow())
