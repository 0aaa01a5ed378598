"""`sluice`: the command line. Parse, build config, call one function.

    sluice run FILE [-n NAME] [--env K=V]     everything in the foreground (controlplane.run)
    sluice up FILE [-n NAME] [--env K=V] [-y] ops commands: Redis only (controlplane.ops)
    sluice update NAME FILE [--mode MODE]
    sluice down NAME... | -a  [--purge] [--replica-id ID] [-y]
    sluice status [NAME...] [-v] [--json] [--endpoint]
    sluice replica add|remove NAME URL
    sluice replica preempt NAME ID
    sluice snapshot NAME [--json] [--watch]
    sluice logs NAME [ID...] [--controller] [--load-balancer] [--no-follow] [--tail N]

The commands and options `sky serve` has take the same names and arguments (SkyPilot
0.14.1, sky/client/cli/command.py), so a Sky Serve user's habits work here.
    sluice controller                         long-running: the controller
    sluice proxy                              long-running: = sluice-proxy

Every command takes `--redis URL` (env SLUICE_REDIS_URL), `--redis-ca-file` (env
SLUICE_REDIS_CA_FILE) and `--prefix` (env SLUICE_PREFIX); without `--redis`, the
ops commands use the Redis of a `sluice run` alive on `--state-dir` (its
`run.json`, and the password from the 0600 file it names), else
redis://127.0.0.1:6379/0. Service names are checked (`check_service_name`)
before any Redis call or path.
Other options follow click's `auto_envvar_prefix="SLUICE"` (SLUICE_RUN_PORT ...).

Errors are translated here, at one boundary (`_errors`), into one line on stderr
and exit code 1: a SpecError names the file and the field path, an unreachable
Redis names the URL (password redacted). A spec is loaded and validated before
any connection to Redis, so an invalid file never reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec

from controlplane import ops
from controlplane.controller import ControllerConfig, run_controller
from controlplane.display import snapshot_text, status_text
from controlplane.records import Handle, ReplicaRecord, check_service_name
from controlplane.run import RunConfig, read_run_info, run_redis_url, run_service
from controlplane.spec import ServiceSpec, SpecError, load_spec
from controlplane.statedir import redact_url
from controlplane.states import UpdateMode
from controlplane.store import ServiceNotFound, Store, StoreError, StoreUnavailable
from proxy.cli import check_redis_url, proxy_command
from proxy.wire.errors import SluiceError
from proxy.wire.keys import DEFAULT_PREFIX

T = TypeVar("T")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STATE_DIR = "~/.sluice"
LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)
_FOLLOW_POLL = 0.25  # seconds between looks at a followed log file


@dataclass(frozen=True)
class Target:
    """Where the ops commands find sluice's state: a Redis URL, its CA file, a key prefix."""

    url: str
    prefix: str
    ca_file: str | None = None


# -- the error boundary ----------------------------------------------------------------------


@contextlib.contextmanager
def _errors(url: str | None = None) -> Iterator[None]:
    """Turn sluice's errors into one line on stderr and exit code 1 (click prints it)."""
    try:
        yield
    except StoreUnavailable as exc:
        detail = str(exc).removeprefix("redis unavailable: ")
        where = f" at {redact_url(url)}" if url else ""
        raise click.ClickException(_one_line(f"cannot reach Redis{where}: {detail}")) from exc
    except (SpecError, SluiceError, ValueError, TimeoutError) as exc:
        # SpecError names the file and field path; the store's and the ops' errors
        # (ServiceNotFound, ServiceExists, OpsError ...) say what went wrong.
        raise click.ClickException(_one_line(str(exc) or type(exc).__name__)) from exc


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 3 else " ".join(lines[:3]) + " ..."


def _with_store(target: Target, fn: Callable[[Store], Awaitable[T]]) -> T:
    """Run `fn(store)` on a fresh event loop with a store on `target`, closed afterwards."""

    async def main() -> T:
        async with Store.from_url(target.url, prefix=target.prefix,
                                  ca_file=target.ca_file) as store:  # fmt: skip
            return await fn(store)

    with _errors(target.url):
        return asyncio.run(main())


# -- shared options --------------------------------------------------------------------------


_REDIS_HELP = (
    "Redis URL (redis://, rediss://, unix://, or redis+sentinel://host:port[,host:port...]"
    "/service-name[/db]; password allowed). Default: the Redis of a "
    f"`sluice run` on --state-dir, else {DEFAULT_REDIS_URL}. Env: SLUICE_REDIS_URL."
)


def _redis_options(
    redis_help: str = _REDIS_HELP,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--redis, --redis-ca-file, --prefix and --state-dir, on every command that reads
    sluice's state. The CA file is not a parameter of the commands: `_target` reads it."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            "--redis-ca-file",
            type=click.Path(exists=True, dir_okay=False),
            envvar="SLUICE_REDIS_CA_FILE",
            expose_value=False,
            callback=_keep_ca_file,
            help="CA certificate(s) that signed a rediss:// server's certificate (default: "
            "the system's). Env: SLUICE_REDIS_CA_FILE.",
        )(command)
        command = click.option(
            "--state-dir",
            type=click.Path(file_okay=False, path_type=Path),
            envvar="SLUICE_STATE_DIR",
            default=DEFAULT_STATE_DIR,
            show_default=True,
            help="Where logs and `sluice run`'s run.json live. Env: SLUICE_STATE_DIR.",
        )(command)
        command = click.option(
            "--prefix",
            envvar="SLUICE_PREFIX",
            default=DEFAULT_PREFIX,
            show_default=True,
            help="Redis key prefix. Env: SLUICE_PREFIX.",
        )(command)
        return click.option(
            "--redis", "redis_url", envvar="SLUICE_REDIS_URL", metavar="URL", help=redis_help,
            callback=check_redis_url,
        )(command)

    return decorate


_CA_FILE = "sluice.redis_ca_file"


def _keep_ca_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    ctx.meta[_CA_FILE] = value


def _ca_file() -> str | None:
    value: str | None = click.get_current_context().meta.get(_CA_FILE)
    return value


def _state_dir(path: Path) -> Path:
    return path.expanduser().resolve()


def _target(redis_url: str | None, prefix: str, state_dir: Path) -> Target:
    """Explicit --redis; else the Redis of a live `sluice run` on the state dir (with its
    password, CA file and prefix unless given); else the default URL."""
    ca_file = _ca_file()
    if redis_url:
        return Target(redis_url, prefix, ca_file)
    info = read_run_info(_state_dir(state_dir))
    if info is None:
        return Target(DEFAULT_REDIS_URL, prefix, ca_file)
    ctx = click.get_current_context()
    explicit = ctx.get_parameter_source("prefix") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    )
    with _errors():
        url = run_redis_url(info)
    return Target(url, prefix if explicit else info.prefix, ca_file or info.redis_ca_file)


def _name(name: str) -> str:
    """NAME checked against the service naming rule, as a usage error."""
    try:
        return check_service_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None


def _load(file: Path, overrides: Overrides | None = None) -> ServiceSpec:
    """The validated spec of `file` (with --env / --secret applied); raises the
    one-line error before any Redis call."""
    envs, secrets = overrides if overrides is not None else ({}, {})
    with _errors():
        return load_spec(file, envs=envs, secrets=secrets)


# -- --env, --env-file, --secret, --secret-file (SkyPilot's flags.py) -------------------------

#: (envs, secrets) from the command line, overriding the YAML's.
Overrides = tuple[dict[str, str], dict[str, str]]


def _env_pair(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> list[tuple[str, str]]:
    """KEY=VAL, or KEY alone for the value of KEY in this environment (as SkyPilot)."""
    pairs = []
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            found = os.environ.get(item)
            if found is None:
                raise click.BadParameter(f"{item} is not set in the local environment")
            value = found
        pairs.append((key, value))
    return pairs


def _dotenv(ctx: click.Context, param: click.Parameter, value: Path | None) -> dict[str, str]:
    """A dotenv file, parsed by python-dotenv as SkyPilot parses it."""
    if value is None:
        return {}
    import dotenv

    parsed = dotenv.dotenv_values(value)
    empty = [k for k, v in parsed.items() if v is None]
    if empty:
        raise click.BadParameter(f"{value}: {empty[0]} has no value (write {empty[0]}=...)")
    return {k: v for k, v in parsed.items() if v is not None}


def _env_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--env, --env-file, --secret, --secret-file: values that override the YAML's `envs` and
    `secrets` (and fill `$VAR` in its `service:` section)."""
    options = [
        click.option("--secret-file", type=click.Path(exists=True, dir_okay=False,
                     path_type=Path), callback=_dotenv,
                     help="A dotenv file of secrets; --secret wins over it."),
        click.option("--secret", "secret", multiple=True, metavar="KEY[=VAL]",
                     callback=_env_pair, help="Set a secret (redacted like the YAML's "
                     "`secrets`); KEY alone takes $KEY from this shell. Repeatable."),
        click.option("--env-file", type=click.Path(exists=True, dir_okay=False,
                     path_type=Path), callback=_dotenv,
                     help="A dotenv file of envs; --env wins over it."),
        click.option("--env", "env", multiple=True, metavar="KEY[=VAL]", callback=_env_pair,
                     help="Set an env var of the task; KEY alone takes $KEY from this "
                     "shell. Repeatable."),
    ]  # fmt: skip
    for option in options:
        command = option(command)
    return command


def _overrides(
    env: list[tuple[str, str]],
    env_file: dict[str, str],
    secret: list[tuple[str, str]],
    secret_file: dict[str, str],
) -> Overrides:
    """envs = env file < --env; secrets = secret file < --secret (SkyPilot's
    `_merge_cli_and_file_vars`, except that SkyPilot also loads the env file into the
    secrets, where its values then beat --env in `$VAR` and the replica's environment)."""
    return {**env_file, **dict(env)}, {**secret_file, **dict(secret)}


_YES = click.option("-y", "--yes", is_flag=True, help="Skip the confirmation prompt.")


def _service_name(name: str | None, spec: ServiceSpec, file: Path) -> str:
    chosen = name or spec.name or file.stem
    try:
        return check_service_name(chosen)
    except ValueError as exc:
        hint = "-n/--name" if name else ("the YAML's `name`" if spec.name else "the file name")
        raise click.BadParameter(f"{exc} (choose one with -n)", param_hint=hint) from None


def _check_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} is not an http(s)://host:port URL")
    return value


# -- the group -------------------------------------------------------------------------------


def _check_backend(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """`--backend skypilot` needs SkyPilot importable here: say so before anything starts."""
    if value == "skypilot":
        from controlplane.backends.skypilot_sdk import SkyPilotMissing, load_sky

        try:
            load_sky()
        except SkyPilotMissing as exc:
            raise click.ClickException(f"--backend skypilot: {exc}") from exc
    return value


_backend_option = click.option(
    "--backend",
    type=click.Choice(["local", "skypilot"]),
    default="local",
    show_default=True,
    callback=_check_backend,
    help="What new replicas run on: local processes, or one SkyPilot cluster each "
    "(clouds, Kubernetes; needs `pip install 'sluice[skypilot]'`). Replicas keep the "
    "backend they were launched with.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="sluice", prog_name="sluice")
def cli() -> None:
    """sluice: serve one endpoint in front of many replicas, with gap-free updates.

    \b
    Quick start:
      sluice run examples/echo.yaml        # redis, controller, proxy, replicas; Ctrl-C stops
      sluice status                        # in another terminal
    """


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (default: the YAML's `name`, else the file's).")
@click.option("--host", default="0.0.0.0", show_default=True, help="Proxy listen address.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Proxy port (0: any free port).")  # fmt: skip
@click.option("--admin-port", type=click.IntRange(0, 65535), default=0,
              help="Proxy admin port on 127.0.0.1 (default: any free port).")  # fmt: skip
@_redis_options(
    "Use this Redis instead of starting a private redis-server (the default). "
    "Env: SLUICE_REDIS_URL."
)
@click.option(
    "--drain-seconds",
    type=click.FloatRange(0),
    default=5.0,
    show_default=True,
    help="How long a replica leaving service keeps running before it is stopped.",
)
@click.option(
    "--down-timeout",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    help="On Ctrl-C, how long to wait for the controller to stop the replicas.",
)
@_backend_option
@click.option("--log-level", type=LOG_LEVELS, default="INFO", show_default=True)
@_env_options
def run(
    file: Path,
    name: str | None,
    host: str,
    port: int,
    admin_port: int,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
    drain_seconds: float,
    down_timeout: float,
    backend: str,
    log_level: str,
    env: list[tuple[str, str]],
    env_file: dict[str, str],
    secret: list[tuple[str, str]],
    secret_file: dict[str, str],
) -> None:
    """Run FILE's service in the foreground: Redis, controller, proxy, replicas.

    Starts a private redis-server unless --redis is given, the controller and the
    proxy as child processes (logs under --state-dir), registers the service and
    shows its replicas coming up. Ctrl-C takes the service down, waits for the
    replicas to be stopped, and stops everything it started.

    \b
    Example:
      sluice run examples/echo.yaml --port 8080
    """
    spec = _load(file, _overrides(env, env_file, secret, secret_file))
    config = RunConfig(
        spec=spec,
        name=_service_name(name, spec, file),
        state_dir=_state_dir(state_dir),
        redis_url=redis_url,
        redis_ca_file=_ca_file(),
        prefix=prefix,
        host=host,
        port=port,
        admin_port=admin_port,
        drain_seconds=drain_seconds,
        down_timeout=down_timeout,
        log_level=log_level.upper(),
        backend=backend,
    )
    with _errors(redis_url):
        code = run_service(config)
    sys.exit(code)


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (default: the YAML's `name`, else the file's).")
@click.option("--endpoint", metavar="URL", help="Where clients reach the service (shown by "
              "`sluice status`), e.g. the URL of its sluice-proxy.")  # fmt: skip
@_env_options
@_YES
@_redis_options()
def up(
    file: Path,
    name: str | None,
    endpoint: str | None,
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

    \b
    Example:
      sluice up examples/echo.yaml -n echo --redis redis://127.0.0.1:6379
      sluice up llm.yaml -n llm --env MODEL_NAME=Qwen/Qwen2.5-0.5B --secret HF_TOKEN
    """
    spec = _load(file, _overrides(env, env_file, secret, secret_file))
    service = _service_name(name, spec, file)
    target = _target(redis_url, prefix, state_dir)
    record = _with_store(target, lambda store: ops.up(store, service, spec, endpoint=endpoint))
    click.echo(f"{record.name}: registered version {record.version}; the controller launches "
               f"{spec.min_replicas} replica(s). Watch: sluice status {record.name}")  # fmt: skip


@cli.command()
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--mode",
    type=click.Choice([m.value for m in UpdateMode], case_sensitive=False),
    default=UpdateMode.ROLLING.value,
    show_default=True,
    help="How the new version takes over (rolling unless given, as in `sky serve update`).",
)
@_env_options
@_YES
@_redis_options()
def update(
    name: str,
    file: Path,
    mode: str,
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
    spec = _load(file, _overrides(env, env_file, secret, secret_file))
    target = _target(redis_url, prefix, state_dir)
    chosen = UpdateMode(mode.lower())
    version = _with_store(target, lambda store: ops.update(store, name, spec, mode=chosen))
    click.echo(f"{name}: updating to version {version} ({chosen.value}). "
               f"Watch: sluice status {name}")  # fmt: skip


@cli.command()
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
@_YES
@_redis_options()
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
    target = _target(redis_url, prefix, state_dir)

    async def chosen(store: Store) -> list[str]:
        return await store.services() if all_ else await ops.match_services(store, list(names))

    services = _with_store(target, chosen)
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
        name = services[0]
        action = _with_store(
            target, lambda store: ops.terminate_replica(store, name, replica_id, purge=purge)
        )
        click.echo(f"{name}: replica {replica_id} {action}")
        return

    async def take_down(store: Store) -> None:
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

    _with_store(target, take_down)


def _handles(replicas: list[ReplicaRecord]) -> str:
    return ", ".join(
        f"replica {r.id} ({', '.join(f'{k} {v}' for k, v in r.handle.items() if k != 'log')})"
        for r in replicas
    )


@cli.command()
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
@click.option("--max-lag-generations", type=click.IntRange(0), default=2, show_default=True,
              help="Flag a proxy more than this many generations behind Redis.")
@click.option("--max-lag-seconds", type=click.FloatRange(0), default=5.0, show_default=True,
              help="Flag a proxy behind (or silent) for longer than this.")
@_redis_options()
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
    target = _target(redis_url, prefix, state_dir)

    lag = ops.LagLimits(max_lag_generations, max_lag_seconds)

    async def views_of(store: Store) -> list[ops.ServiceView]:
        if not names:
            return await ops.status(store, None, lag=lag)
        return [view for name in dict.fromkeys(names)
                for view in await ops.status(store, name, lag=lag)]

    views = _with_store(target, views_of)
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


@cli.group()
def replica() -> None:
    """Register or remove external replicas (the controller probes them, never runs them)."""


@replica.command("add")
@click.argument("name")
@click.argument("url", callback=_check_url)
@click.option("--accelerator", metavar="NAME[:COUNT]", help="e.g. A100:1; used by "
              "instance_aware_least_load to look up the target QPS.")  # fmt: skip
@click.option("--spot", is_flag=True, help="The replica runs on a spot instance.")
@_redis_options()
def replica_add(
    name: str,
    url: str,
    accelerator: str | None,
    spot: bool,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Register the replica at URL with service NAME.

    \b
    Example:
      sluice replica add llm http://10.0.0.7:8000 --accelerator A100:1
    """
    target = _target(redis_url, prefix, state_dir)
    replica_id = _with_store(
        target,
        lambda store: ops.add_replica(store, name, url, accelerator=accelerator, spot=spot),
    )
    click.echo(f"{name}: replica {replica_id} at {url.rstrip('/')} registered; "
               "it is routed once its readiness probe passes")  # fmt: skip


@replica.command("remove")
@click.argument("name")
@click.argument("url", callback=_check_url)
@_redis_options()
def replica_remove(
    name: str, url: str, redis_url: str | None, prefix: str, state_dir: Path
) -> None:
    """Take the external replica at URL out of service NAME (it is not stopped).

    \b
    Example:
      sluice replica remove llm http://10.0.0.7:8000
    """
    target = _target(redis_url, prefix, state_dir)
    _with_store(target, lambda store: ops.remove_replica(store, name, url))
    click.echo(f"{name}: replica at {url.rstrip('/')} removed from the ready set")


@replica.command("preempt")
@click.argument("name")
@click.argument("replica_id", metavar="ID", type=click.IntRange(1))
@_redis_options()
def replica_preempt(
    name: str, replica_id: int, redis_url: str | None, prefix: str, state_dir: Path
) -> None:
    """Simulate the preemption of replica ID of service NAME (testing spot fallback).

    It leaves the ready set at once (PREEMPTED); the controller terminates it and
    launches a replacement.

    \b
    Example:
      sluice replica preempt llm 3
    """
    target = _target(redis_url, prefix, state_dir)
    _with_store(target, lambda store: ops.preempt_replica(store, name, replica_id))
    click.echo(f"{name}: replica {replica_id} preempted; the controller replaces it")


@cli.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON (one line "
              "per generation with --watch).")  # fmt: skip
@click.option("--watch", is_flag=True, help="Keep printing every new generation; Ctrl-C stops.")
@_redis_options()
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
    target = _target(redis_url, prefix, state_dir)

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
        show(_with_store(target, current))
        return
    _with_store(target, current)  # a missing service is an error, not an endless wait

    async def follow() -> None:
        first = True
        async with Store.from_url(target.url, prefix=target.prefix,
                                  ca_file=target.ca_file) as store:  # fmt: skip
            async for snap in store.follow_snapshots(name):
                if not first and not as_json:
                    click.echo("")
                first = False
                show(snap)

    with _errors(target.url), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follow())


@cli.command()
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
@_redis_options()
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
    """Print logs of service NAME: --controller, --load-balancer, or replica IDs.

    Logs live under --state-dir: controller.log, NAME/proxy.log and, for replicas
    of the local backend, the path in the replica's handle (NAME/replica-ID.log).
    Several logs are printed one after another, each under a `==> path <==` line,
    and followed together.

    \b
    Examples:
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
    directory = _state_dir(state_dir)
    name = _name(name)
    paths: list[Path] = []
    if controller:
        paths.append(directory / "controller.log")
    if load_balancer:
        paths.append(directory / name / "proxy.log")
    ids = list(dict.fromkeys([*replica_ids, *replica_opts]))
    if ids:
        target = _target(redis_url, prefix, state_dir)
        for replica_id in ids:
            cluster = _skypilot_handle(target, name, replica_id)
            if cluster is not None:
                # SkyPilot streams a cluster's job log itself: one log per command.
                if len(ids) > 1 or paths:
                    raise click.UsageError(
                        f"replica {replica_id} runs on SkyPilot: show its log on its own "
                        f"(sluice logs {name} {replica_id})"
                    )
                code = 0
                with _errors(target.url), contextlib.suppress(KeyboardInterrupt):
                    code = _skypilot_logs(cluster, follow)
                sys.exit(code)
            paths.append(_replica_log(target, directory, name, replica_id))
    if not paths:
        raise click.UsageError("choose a log: --controller, --load-balancer, or replica IDs")
    for path in paths:
        if not path.is_file():
            raise click.ClickException(f"no log at {path}")
    with contextlib.suppress(KeyboardInterrupt):
        _print_files(paths, follow=follow, tail=tail)


def _skypilot_handle(target: Target, name: str, replica_id: int) -> Handle | None:
    """The handle of replica `replica_id` when it runs on SkyPilot, else None."""

    async def lookup(store: Store) -> ReplicaRecord | None:
        return await store.replica(name, replica_id)

    with contextlib.suppress(click.ClickException):
        record = _with_store(target, lookup)
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


def _replica_log(target: Target, state_dir: Path, name: str, replica_id: int) -> Path:
    """The log path in the replica's handle; the local backend's default path when the
    record is gone (a terminated replica) or Redis cannot say."""
    fallback = state_dir / name / f"replica-{replica_id}.log"

    async def lookup(store: Store) -> ReplicaRecord | None:
        record = await store.replica(name, replica_id)
        if record is None and await store.service(name) is None:
            raise ServiceNotFound(f"no service {name!r}")
        return record

    try:
        record = _with_store(target, lookup)
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


@cli.command()
@_redis_options()
@click.option(
    "--drain-seconds",
    type=click.FloatRange(0),
    default=120.0,
    show_default=True,
    help="How long a replica leaving service keeps running before it is stopped.",
)
@click.option(
    "--lease-ttl",
    type=click.FloatRange(0, min_open=True),
    default=10.0,
    show_default=True,
    help="Leader lease TTL; a standby takes over after it.",
)
@click.option(
    "--holder",
    help="This controller's name in the leader lease (default: host and pid); a random "
    "token is appended, so two controllers given the same name never both lead.",
)
@click.option(
    "--reconcile-interval",
    type=click.FloatRange(0, min_open=True),
    default=1.0,
    show_default=True,
    help="Seconds between reconcile passes without nudges.",
)
@click.option(
    "--term-timeout",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="Seconds from SIGTERM to SIGKILL when stopping a local replica.",
)
@click.option(
    "--terminate-on-exit",
    is_flag=True,
    help="Stop every replica when this "
    "controller exits (what `sluice run` asks); by default they keep running and "
    "the next controller adopts them.",
)
@_backend_option
@click.option("--log-level", type=LOG_LEVELS, default="INFO", show_default=True)
def controller(
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
    drain_seconds: float,
    lease_ttl: float,
    holder: str | None,
    reconcile_interval: float,
    term_timeout: float,
    terminate_on_exit: bool,
    backend: str,
    log_level: str,
) -> None:
    """Run the controller until SIGTERM: reconcile every service in Redis.

    Replica logs go under --state-dir. Run two for failover: one holds the
    leader lease, the other stands by.

    \b
    Example:
      sluice controller --redis redis://127.0.0.1:6379 --state-dir /var/lib/sluice
    """
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    target = _target(redis_url, prefix, state_dir)
    config = ControllerConfig(
        redis_url=target.url,
        redis_ca_file=target.ca_file,
        prefix=target.prefix,
        state_dir=_state_dir(state_dir),
        drain_seconds=drain_seconds,
        lease_ttl=lease_ttl,
        holder=holder,
        reconcile_interval=reconcile_interval,
        term_timeout=term_timeout,
        terminate_on_close=terminate_on_exit,
        backend=backend,
    )
    with _errors(target.url):
        _serve_controller(config)


def _serve_controller(config: ControllerConfig) -> None:
    """run_controller on uvloop until SIGTERM or SIGINT, then cancel it and wait."""
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = asyncio.create_task(run_controller(config), name="sluice-controller")
        stopper = asyncio.create_task(stop.wait(), name="sluice-controller-stop")
        try:
            await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not runner.done():
                runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner  # re-raises what ended it early (e.g. Redis unreachable)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve())


cli.add_command(proxy_command, name="proxy")


def main() -> None:
    """The `sluice` console script."""
    cli(auto_envvar_prefix="SLUICE")


if __name__ == "__main__":
    main()
