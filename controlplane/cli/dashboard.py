"""`sluice dashboard`: serve the read-only fleet page (controlplane.dashboard)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import click

from controlplane.cli.common import errors, redis_options, target_of
from controlplane.dashboard import DashboardConfig, DashboardConfigError, serve
from controlplane.store import Store

_DEFAULTS = DashboardConfig()


@click.command()
@click.option("--host", default=_DEFAULTS.host, show_default=True,
              help="Address to listen on. Anything but loopback needs --token or TLS.")
@click.option("--port", type=click.IntRange(0, 65535), default=_DEFAULTS.port,
              show_default=True)
@click.option("--token", envvar="SLUICE_DASHBOARD_TOKEN", metavar="TOKEN",
              help="Require this bearer token (>= 16 characters; open the page once with "
              "?token=TOKEN, it is then kept in a cookie). Env: SLUICE_DASHBOARD_TOKEN "
              "(prefer it: argv is visible to other users).")
@click.option("--tls-certfile", type=click.Path(dir_okay=False), help="Serve HTTPS: cert.")
@click.option("--tls-keyfile", type=click.Path(dir_okay=False), help="Serve HTTPS: key.")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=_DEFAULTS.interval,
              show_default=True, help="Seconds between reads of Redis (one read of the "
              "fleet per interval, whatever the number of open pages).")
@redis_options()
def dashboard(
    host: str,
    port: int,
    token: str | None,
    tls_certfile: str | None,
    tls_keyfile: str | None,
    interval: float,
    redis_url: str | None,
    prefix: str,
    state_dir: Path,
) -> None:
    """Serve a live, read-only web page of the fleet (services, replicas, proxies,
    charts, events, rollouts) until Ctrl-C.

    \b
    Example:
      sluice run examples/echo.yaml &      # or any fleet in Redis
      sluice dashboard                     # then open http://127.0.0.1:8090/
    """
    config = DashboardConfig(host=host, port=port, token=token or None,
                             tls_certfile=tls_certfile, tls_keyfile=tls_keyfile,
                             interval=interval)  # fmt: skip
    try:
        for warning in config.check():
            click.echo(f"warning: {warning}", err=True)
    except DashboardConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    target = target_of(redis_url, prefix, state_dir)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        async with Store.from_url(target.url, prefix=target.prefix,
                                  ca_file=target.ca_file) as store:  # fmt: skip
            await serve(store, config,
                        on_listening=lambda url: click.echo(f"dashboard: {url}"))  # fmt: skip

    with errors(target.url), contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())
