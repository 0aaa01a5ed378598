"""The long-running commands: `sluice run` (everything in the foreground) and
`sluice controller`; `sluice proxy` is the proxy's own command (`proxy.cli`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import click

from controlplane.backends.fit import check_backend, check_run_command
from controlplane.cli import dryrun
from controlplane.cli.common import (
    DRY_RUN,
    backend_option,
    env_options,
    errors,
    given_ca_file,
    load_file,
    log_level_option,
    overrides,
    redis_options,
    resolve_state_dir,
    service_name,
    target_of,
)
from controlplane.reconcile import ControllerConfig, run_controller
from controlplane.run import RunConfig, run_service


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "--name", help="Service name (default: the YAML's `name`, else the file's).")
@click.option("--host", default=RunConfig.host, show_default=True, help="Proxy listen address.")
@click.option("--port", type=click.IntRange(0, 65535), default=RunConfig.port, show_default=True,
              help="Proxy port (0: any free port).")  # fmt: skip
@click.option("--admin-port", type=click.IntRange(0, 65535), default=RunConfig.admin_port,
              help="Proxy admin port on 127.0.0.1 (default: any free port).")  # fmt: skip
@redis_options(
    "Use this Redis instead of starting a private redis-server (the default). "
    "Env: SLUICE_REDIS_URL."
)
@click.option(
    "--max-drain-seconds",
    "--drain-seconds",
    "drain_seconds",
    type=click.FloatRange(0),
    default=RunConfig.drain_seconds,
    show_default=True,
    help="The longest a replica leaving service is kept while proxies still have requests "
    "on it (it is stopped as soon as they have none); a service's "
    "service.sluice.max_drain_seconds overrides it.",
)
@click.option(
    "--down-timeout",
    type=click.FloatRange(0),
    default=RunConfig.down_timeout,
    help="On Ctrl-C, how long to wait for the replicas to drain and be stopped (a second "
    "Ctrl-C stops them at once). Default: the drain bound + 30 s.",
)
@backend_option
@log_level_option
@DRY_RUN
@env_options
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
    down_timeout: float | None,
    backend: str,
    log_level: str,
    dry_run: bool,
    env: list[tuple[str, str]],
    env_file: dict[str, str],
    secret: list[tuple[str, str]],
    secret_file: dict[str, str],
) -> None:
    """Run FILE's service in the foreground: Redis, controller, proxy, replicas.

    The proxy listens on --host (127.0.0.1 unless given; 0.0.0.0 serves other
    machines); its admin port (/metrics, /snapshot) is printed. The run ends with exit
    code 1 and a one-line reason when the service can never become ready (every replica
    of its only version failed before it was ever ready). --dry-run validates FILE and
    prints what would start, without Redis.

    Starts a private redis-server unless --redis is given, the controller and the
    proxy as child processes (logs under --state-dir), registers the service and
    shows its replicas coming up. Ctrl-C takes the service down, waits for the
    replicas to be stopped, and stops everything it started.

    \b
    Example:
      sluice run examples/echo.yaml --port 8080
    """
    spec = load_file(file, overrides(env, env_file, secret, secret_file))
    service, naming = service_name(name, spec, file)
    with errors():
        check_backend(spec, backend)
        check_run_command(spec, backend)
    if dry_run:
        where = "a private redis-server" if redis_url is None else "no redis-server (--redis)"
        dryrun.show(service, naming, spec, backend, [
            f"start {where}, the controller, and the proxy listening on {host}:{port} "
            f"(admin on {f'127.0.0.1:{admin_port}' if admin_port else 'a free 127.0.0.1 port'}"
            "), logs under "
            f"{resolve_state_dir(state_dir)}",
            f"register {service} and launch {dryrun.replicas_text(spec)}",
            dryrun.replica_text(spec, backend),
        ])  # fmt: skip
        return
    if naming:
        click.echo(f"sluice: service name {service}{naming}")
    config = RunConfig(
        spec=spec,
        name=service,
        state_dir=resolve_state_dir(state_dir),
        redis_url=redis_url,
        redis_ca_file=given_ca_file(),
        prefix=prefix,
        host=host,
        port=port,
        admin_port=admin_port,
        drain_seconds=drain_seconds,
        down_timeout=down_timeout,
        log_level=log_level.upper(),
        backend=backend,
    )
    with errors(redis_url):
        code = run_service(config)
    sys.exit(code)


@click.command()
@redis_options()
@click.option(
    "--max-drain-seconds",
    "--drain-seconds",
    "drain_seconds",
    type=click.FloatRange(0),
    default=ControllerConfig.drain_seconds,
    show_default=True,
    help="The longest a replica leaving service is kept while proxies still have requests "
    "on it (it is stopped as soon as they have none); a service's "
    "service.sluice.max_drain_seconds overrides it.",
)
@click.option(
    "--lease-ttl",
    type=click.FloatRange(0, min_open=True),
    default=ControllerConfig.lease_ttl,
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
    default=ControllerConfig.reconcile_interval,
    show_default=True,
    help="Seconds between reconcile passes without nudges.",
)
@click.option(
    "--term-timeout",
    type=click.FloatRange(0),
    default=ControllerConfig.term_timeout,
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
@backend_option
@log_level_option
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
    target = target_of(redis_url, prefix, state_dir)
    config = ControllerConfig(
        redis_url=target.url,
        redis_ca_file=target.ca_file,
        prefix=target.prefix,
        state_dir=resolve_state_dir(state_dir),
        drain_seconds=drain_seconds,
        lease_ttl=lease_ttl,
        holder=holder,
        reconcile_interval=reconcile_interval,
        term_timeout=term_timeout,
        terminate_on_exit=terminate_on_exit,
        backend=backend,
    )
    with errors(target.url):
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
