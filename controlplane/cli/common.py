"""What every `sluice` command shares: the error boundary, the store on a fresh loop,
--redis/--prefix/--state-dir and where they lead (`target_of`), --env/--secret and
their files, spec loading, name checks, --backend, --log-level.

Errors are translated here, at one boundary (`errors`), into one line on stderr
and exit code 1: a SpecError names the file and the field path, an unreachable
Redis names the URL (password redacted). A spec is loaded and validated before
any connection to Redis, so an invalid file never reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from controlplane.records import SERVICE_NAME_MAX, check_service_name
from controlplane.run import RunConfig, read_run_info, run_redis_url
from controlplane.servicespec import ServiceSpec, SpecError, load_spec
from controlplane.statedir import DEFAULT_STATE_DIR, redact_url
from controlplane.store import Store, StoreUnavailable
from proxy.cli import check_redis_url
from proxy.wire.errors import SluiceError
from proxy.wire.keys import DEFAULT_PREFIX

T = TypeVar("T")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)




@dataclass(frozen=True)
class Target:
    """Where the ops commands find sluice's state: a Redis URL, its CA file, a key prefix."""

    url: str
    prefix: str
    ca_file: str | None = None
    # The state dir with no live `sluice run` when `url` is only the default guess: an
    # unreachable Redis then means "nothing is running here", said so.
    no_run_on: Path | None = None


# -- the error boundary ----------------------------------------------------------------------


@contextlib.contextmanager
def errors(url: str | None = None, *, no_run_on: Path | None = None) -> Iterator[None]:
    """Turn sluice's errors into one line on stderr and exit code 1 (click prints it).
    `no_run_on`: the state dir without a `sluice run`, where `url` was only the default."""
    try:
        yield
    except StoreUnavailable as exc:
        detail = str(exc).removeprefix("redis unavailable: ")
        if no_run_on is not None:
            raise click.ClickException(
                f"no `sluice run` is active on this state dir ({no_run_on}), and no Redis "
                f"answers at {redact_url(url or DEFAULT_REDIS_URL)}: start `sluice run FILE`, "
                "or give --redis URL (or --state-dir of the run)"
            ) from exc
        where = f" at {redact_url(url)}" if url else ""
        raise click.ClickException(one_line(f"cannot reach Redis{where}: {detail}")) from exc
    except (SpecError, SluiceError, ValueError, TimeoutError) as exc:
        # SpecError names the file and field path; the store's and the ops' errors
        # (ServiceNotFound, ServiceExists, OpsError ...) say what went wrong.
        raise click.ClickException(one_line(str(exc) or type(exc).__name__)) from exc


def one_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 3 else " ".join(lines[:3]) + " ..."


def with_store(target: Target, fn: Callable[[Store], Awaitable[T]]) -> T:
    """Run `fn(store)` on a fresh event loop with a store on `target`, closed afterwards."""

    async def main() -> T:
        async with Store.from_url(target.url, prefix=target.prefix,
                                  ca_file=target.ca_file) as store:  # fmt: skip
            return await fn(store)

    with errors(target.url, no_run_on=target.no_run_on):
        return asyncio.run(main())


# -- shared options --------------------------------------------------------------------------


REDIS_HELP = (
    "Redis URL (redis://, rediss://, unix://, or redis+sentinel:// (rediss+sentinel:// for "
    "TLS) host:port[,host:port...]/service-name[/db]; password allowed). Default: the Redis of a "
    f"`sluice run` on --state-dir, else {DEFAULT_REDIS_URL}. Env: SLUICE_REDIS_URL."
)


def redis_options(
    redis_help: str = REDIS_HELP,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--redis, --redis-ca-file, --prefix and --state-dir, on every command that reads
    sluice's state. The CA file is not a parameter of the commands: `target_of` reads it."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            "--redis-ca-file",
            type=click.Path(exists=True, dir_okay=False),
            envvar="SLUICE_REDIS_CA_FILE",
            expose_value=False,
            callback=_keep_ca_file,
            help="CA certificate(s) that signed a rediss:// or rediss+sentinel:// server's "
            "certificate (default: the system's). Env: SLUICE_REDIS_CA_FILE.",
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


def given_ca_file() -> str | None:
    value: str | None = click.get_current_context().meta.get(_CA_FILE)
    return value


def resolve_state_dir(path: Path) -> Path:
    return path.expanduser().resolve()


def target_of(redis_url: str | None, prefix: str, state_dir: Path) -> Target:
    """Explicit --redis; else the Redis of a live `sluice run` on the state dir (with its
    password, CA file and prefix unless given); else the default URL."""
    ca_file = given_ca_file()
    if redis_url:
        return Target(redis_url, prefix, ca_file)
    info = read_run_info(resolve_state_dir(state_dir))
    if info is None:
        return Target(DEFAULT_REDIS_URL, prefix, ca_file,
                      no_run_on=resolve_state_dir(state_dir))  # fmt: skip
    ctx = click.get_current_context()
    explicit = ctx.get_parameter_source("prefix") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    )
    with errors():
        url = run_redis_url(info)
    return Target(url, prefix if explicit else info.prefix, ca_file or info.redis_ca_file)


def checked_name(name: str) -> str:
    """NAME checked against the service naming rule, as a usage error."""
    try:
        return check_service_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None


def load_file(file: Path, overrides: Overrides | None = None) -> ServiceSpec:
    """The validated spec of `file` (with --env / --secret applied); raises the
    one-line error before any Redis call."""
    envs, secrets = overrides if overrides is not None else ({}, {})
    with errors():
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


def env_options(command: Callable[..., Any]) -> Callable[..., Any]:
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


def overrides(
    env: list[tuple[str, str]],
    env_file: dict[str, str],
    secret: list[tuple[str, str]],
    secret_file: dict[str, str],
) -> Overrides:
    """envs = env file < --env; secrets = secret file < --secret (SkyPilot's
    `_merge_cli_and_file_vars`, except that SkyPilot also loads the env file into the
    secrets, where its values then beat --env in `$VAR` and the replica's environment)."""
    return {**env_file, **dict(env)}, {**secret_file, **dict(secret)}


YES = click.option("-y", "--yes", is_flag=True, help="Skip the confirmation prompt.")
# Eager, so that --backend's callback knows it: a dry run needs no SkyPilot installed.
DRY_RUN = click.option("--dry-run", is_flag=True, is_eager=True,
                       help="Validate FILE and print the normalised spec (secrets redacted) "
                       "and what would run; touches no Redis, starts nothing.")  # fmt: skip
#: --backend of `up` and `update`: what the spec is checked against (the controller's).
BACKEND = click.option(
    "--backend", type=click.Choice(["local", "skypilot"]), default=None,
    help="The backend the controller launches replicas with, to check FILE against "
    "(default: that of the `sluice run` on --state-dir, else local).",
)  # fmt: skip


def service_name(name: str | None, spec: ServiceSpec, file: Path) -> tuple[str, str]:
    """The service name and where it came from (for the line the commands print).

    -n is taken as given and must be valid. Without it the name comes from the YAML's
    `name`, else the file name, made valid the way a DNS label is (lowercase; `_`, `.`
    and other characters become `-`; a leading digit dropped: `lb_autoscale_wd.yaml` is
    `lb-autoscale-wd`); when nothing is left, one is generated (`sluice-service-1a2b`,
    as Sky Serve generates `sky-service-1a2b`)."""
    if name:
        try:
            return check_service_name(name), ""
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="-n/--name") from None
    source, given = ("the YAML's `name`", spec.name) if spec.name else ("the file name", file.name)
    derived = valid_name(spec.name or file.name.removesuffix(".yaml").removesuffix(".yml"))
    if derived is None:
        generated = f"sluice-service-{secrets.token_hex(2)}"
        return generated, f" (generated: {source} {given!r} gives none; choose one with -n)"
    return derived, f" (from {source} {given!r}; choose another with -n)"


def valid_name(text: str) -> str | None:
    """`text` as a valid service name, or None when no letter survives."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower())
    name = re.sub(r"^[^a-z]+", "", name)[:SERVICE_NAME_MAX].rstrip("-")
    return name or None


def check_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} is not an http(s)://host:port URL")
    return value


# -- --backend, --log-level -----------------------------------------------------------------


def _check_backend(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """`--backend skypilot` needs SkyPilot importable here: say so before anything starts."""
    if value == "skypilot" and not ctx.params.get("dry_run"):
        from controlplane.backends.skypilot_sdk import SkyPilotMissing, load_sky

        try:
            load_sky()
        except SkyPilotMissing as exc:
            raise click.ClickException(f"--backend skypilot: {exc}") from exc
    return value


backend_option = click.option(
    "--backend",
    type=click.Choice(["local", "skypilot"]),
    default=RunConfig.backend,
    show_default=True,
    callback=_check_backend,
    help="What new replicas run on: local processes, or one SkyPilot cluster each "
    "(clouds, Kubernetes; needs `pip install 'sluice[skypilot]'`). Replicas keep the "
    "backend they were launched with.",
)


#: --log-level, for `sluice run` and `sluice controller` (the default is RunConfig's).
log_level_option = click.option(
    "--log-level", type=LOG_LEVELS, default=RunConfig.log_level, show_default=True
)
