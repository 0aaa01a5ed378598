"""The service commands: `sluice up`, `update`, `down`, `status` (`snapshot` is
cli/snapshot.py's). They talk to Redis only (through `controlplane.ops` and the store)."""

from __future__ import annotations

import time
from pathlib import Path

import click
import msgspec

from controlplane import ops
from controlplane.backends.fit import check_backend
from controlplane.cli import dryrun
from controlplane.cli.common import (
    BACKEND,
    DRY_RUN,
    YES,
    Target,
    checked_name,
    env_options,
    errors,
    load_file,
    overrides,
    redis_options,
    resolve_state_dir,
    service_name,
    target_of,
    with_store,
)
from controlplane.display import status_text
from controlplane.records import ReplicaRecord
from controlplane.run import read_run_info
from controlplane.states import UpdateMode
from controlplane.store import ServiceNotFound, Store


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (default: the YAML's `name`, else the "
              "file's, made valid: lb_test.yaml is lb-test).")  # fmt: skip
@click.option("--endpoint", metavar="URL", help="Where clients reach the service (shown by "
              "`sluice status`), e.g. the URL of its sluice-proxy.")  # fmt: skip
@BACKEND
@DRY_RUN
@env_options
@YES
@redis_options()
def up(
    file: Path,
    name: str | None,
    endpoint: str | None,
    backend: str | None,
    dry_run: bool,
    env: list[tuple[str, str]],
    env_file: dict[str, str],
    secret: list[tuple[str, str]],
    secret_file: dict[str, str],
    yes: bool,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Register FILE's service; the controller launches its replicas.

    -y is accepted as `sky serve up` takes it; there is no cost to confirm here.
    --dry-run validates FILE for the backend and prints what would be registered,
    without Redis.

    \b
    Example:
      sluice up examples/echo.yaml -n echo --redis redis://127.0.0.1:6379
      sluice up llm.yaml -n llm --env MODEL_NAME=Qwen/Qwen2.5-0.5B --secret HF_TOKEN
      sluice up llm.yaml --dry-run --backend skypilot
    """
    spec = load_file(file, overrides(env, env_file, secret, secret_file))
    service, naming = service_name(name, spec, file)
    run = read_run_info(resolve_state_dir(state_dir)) if not redis_url else None
    backend = backend or (run.backend if run is not None else "local")
    with errors():
        check_backend(spec, backend)
    if dry_run:
        dryrun.show(service, naming, spec, backend, [
            f"register service {service} (version 1) in Redis; the controller launches "
            f"{dryrun.replicas_text(spec)}",
            dryrun.replica_text(spec, backend),
        ])  # fmt: skip
        return
    target = target_of(redis_url, prefix, state_dir)
    record = with_store(
        target, lambda store: ops.up(store, service, spec, endpoint=endpoint, backend=backend)
    )
    click.echo(f"{record.name}{naming}: registered version {record.version}; the "
               f"controller launches {spec.min_replicas} replica(s). "
               f"Watch: sluice status {record.name}")  # fmt: skip
    if run is not None and run.service != record.name and endpoint is None:
        # The proxy of `sluice run` serves its own service only.
        scheme, sep, rest = run.redis_url.partition("://")
        url = (f"{scheme}://:$(cat {run.redis_password_file})@{rest}"
               if run.redis_password_file and sep else run.redis_url)  # fmt: skip
        click.echo(
            f"{record.name} has no proxy: the one of the `sluice run` on this state dir "
            f"serves {run.service} only. Reach {record.name}'s replicas at the URLs of "
            f"`sluice status {record.name}`, or run a proxy for it (the run's Redis, its "
            f"password read from its file): SLUICE_REDIS_URL=\"{url}\" sluice proxy "
            f"--service {record.name} --port PORT"
        )


@click.command()
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--mode",
    type=click.Choice([m.value for m in UpdateMode], case_sensitive=False),
    default=UpdateMode.ROLLING.value,
    show_default=True,
    help="How the new version takes over (rolling unless given, as in `sky serve update`).",
)
@BACKEND
@DRY_RUN
@env_options
@YES
@redis_options()
def update(
    name: str,
    file: Path,
    mode: str,
    backend: str | None,
    dry_run: bool,
    env: list[tuple[str, str]],
    env_file: dict[str, str],
    secret: list[tuple[str, str]],
    secret_file: dict[str, str],
    yes: bool,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Make FILE the next version of service NAME.

    A count-only change (only `service:` replica counts, probe, policy) relabels
    the running replicas; any other change rolls out new replicas.

    \b
    Example:
      sluice update echo examples/echo.yaml --mode blue_green
    """
    spec = load_file(file, overrides(env, env_file, secret, secret_file))
    chosen = UpdateMode(mode.lower())
    run = read_run_info(resolve_state_dir(state_dir)) if not redis_url else None
    backend = backend or (run.backend if run is not None else "local")
    with errors():
        check_backend(spec, backend)
    if dry_run:
        dryrun.show(checked_name(name), "", spec, backend, [
            f"make FILE the next version of {name} ({chosen.value}): relabel the running "
            "replicas if only replica counts, probe or policy changed, else roll out "
            f"{dryrun.replicas_text(spec)}",
            dryrun.replica_text(spec, backend),
        ])  # fmt: skip
        return
    target = target_of(redis_url, prefix, state_dir)
    version = with_store(
        target, lambda store: ops.update(store, name, spec, mode=chosen, backend=backend)
    )
    click.echo(f"{name}: updating to version {version} ({chosen.value}). "
               f"Watch: sluice status {name}")  # fmt: skip


@click.command()
@click.argument("names", metavar="[NAME]...", nargs=-1)
@click.option("-a", "--all", "all_", is_flag=True, help="Take every service down.")
@click.option(
    "-p",
    "--purge",
    is_flag=True,
    help="Also remove at once a service stuck "
    "SHUTTING_DOWN (its replicas may be left running), or a failed replica.",
)
@click.option(
    "--replica-id",
    type=click.IntRange(1),
    metavar="ID",
    help="Take only this replica of NAME down (it is replaced if the target still wants it).",
)
@YES
@redis_options()
def down(
    names: tuple[str, ...],
    all_: bool,
    purge: bool,
    replica_id: int | None,
    yes: bool,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Take services down (NAME may be a glob): the controller drains and stops their
    replicas. Asks first unless -y.

    \b
    Examples:
      sluice down echo
      sluice down 'llm-*' -y
      sluice down -a -y
      sluice down llm --replica-id 3
    """
    if bool(names) == all_:
        raise click.UsageError("give service NAMEs or --all (one of them)")
    if replica_id is not None and len(names) != 1:
        raise click.UsageError("--replica-id takes exactly one service NAME")
    target = target_of(redis_url, prefix, state_dir)

    async def chosen(store: Store) -> list[str]:
        return await store.services() if all_ else await ops.match_services(store, list(names))

    services = with_store(target, chosen)
    if replica_id is not None and len(services) != 1:
        raise click.UsageError(f"--replica-id takes one service; {names[0]!r} matches "
                               f"{', '.join(services)}")  # fmt: skip
    if not services:
        click.echo("No service to take down.")
        return
    if not yes:
        what = (
            f"replica {replica_id} of {services[0]!r}"
            if replica_id is not None
            else "service(s) " + ", ".join(repr(n) for n in services)
        )
        click.confirm(f"Taking down {what}. Proceed?", default=True, abort=True)
    if replica_id is not None:
        _down_replica(target, services[0], replica_id, purge=purge)
    else:
        with_store(target, lambda store: _take_down(store, services, purge=purge))


def _down_replica(target: Target, name: str, replica_id: int, *, purge: bool) -> None:
    """`sluice down NAME --replica-id ID`."""
    action = with_store(
        target, lambda store: ops.terminate_replica(store, name, replica_id, purge=purge)
    )
    click.echo(f"{name}: replica {replica_id} {action}")


async def _take_down(store: Store, services: list[str], *, purge: bool) -> None:
    """`ops.down` each service, saying what became of it."""
    for name in services:
        try:
            left = await ops.down(store, name, purge=purge)
        except ServiceNotFound:
            continue  # gone since the listing: nothing to do
        if purge and left:
            click.echo(f"{name}: purged; replicas the controller had not stopped may "
                       f"still run: {_handles(left)}")  # fmt: skip
        elif purge:
            click.echo(f"{name}: purged")
        else:
            click.echo(f"{name}: shutting down; the controller drains and stops its "
                       "replicas")  # fmt: skip


def _handles(replicas: list[ReplicaRecord]) -> str:
    return ", ".join(
        f"replica {r.id} ({', '.join(f'{k} {v}' for k, v in r.handle.items() if k != 'log')})"
        for r in replicas
    )


@click.command()
@click.argument("names", metavar="[NAME]...", nargs=-1)
@click.option(
    "-v",
    "--verbose",
    "-a",
    "--all",
    "verbose",
    is_flag=True,
    help="Show every column (policy, update mode, backend, accelerator, spot).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the services as JSON.")
@click.option("--endpoint", is_flag=True, help="Print only the endpoint of the service "
              "(NAME, or the only service there is).")  # fmt: skip
@click.option("--max-lag-generations", type=click.IntRange(0), default=ops.LagLimits.generations,
              show_default=True,
              help="Flag a proxy more than this many generations behind Redis.")
@click.option("--max-lag-seconds", type=click.FloatRange(0), default=ops.LagLimits.seconds,
              show_default=True,
              help="Flag a proxy behind (or silent) for longer than this.")
@redis_options()
def status(
    names: tuple[str, ...],
    verbose: bool,
    as_json: bool,
    endpoint: bool,
    max_lag_generations: int,
    max_lag_seconds: float,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Show services (all, or the NAMEs), their replicas, and the proxies following them.

    Each proxy process (each worker) heartbeats the generation it serves into Redis
    every second; one lagging more than --max-lag-generations behind, or behind or
    silent for more than --max-lag-seconds, is flagged LAGGING.

    \b
    Examples:
      sluice status
      sluice status echo llm -v
      sluice status echo --json
      curl $(sluice status --endpoint)/health
    """
    target = target_of(redis_url, prefix, state_dir)

    lag = ops.LagLimits(max_lag_generations, max_lag_seconds)

    async def views_of(store: Store) -> list[ops.ServiceView]:
        if not names:
            return await ops.status(store, None, lag=lag)
        return [view for name in dict.fromkeys(names)
                for view in await ops.status(store, name, lag=lag)]

    views = with_store(target, views_of)
    if endpoint:
        if len(views) != 1:
            count = str(len(views)) if views else "No"
            raise click.UsageError(f"{count} service{'s' if len(views) != 1 else ''} found; "
                                   "name the one whose endpoint to print")  # fmt: skip
        url = views[0].endpoint
        if not url:
            raise click.ClickException(f"service {views[0].name!r} has no endpoint recorded")
        click.echo(url)
    elif as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(views), indent=2).decode())
    else:
        click.echo(status_text(views, time.time(), verbose=verbose))
        run = None if redis_url else read_run_info(resolve_state_dir(state_dir))
        if run is not None and run.listen:
            click.echo(f"\n`sluice run` (pid {run.pid}) of {run.service}: its proxy listens "
                       f"on {run.listen} (endpoint {run.endpoint}), admin {run.admin} "
                       f"(/metrics, /snapshot); backend {run.backend}")  # fmt: skip
