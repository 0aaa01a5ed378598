"""The `sluice` group: every command, and the console script `main`."""

from __future__ import annotations

import click

from controlplane.cli.dashboard import dashboard
from controlplane.cli.launch import controller, run
from controlplane.cli.logs import logs
from controlplane.cli.replicas import replica
from controlplane.cli.services import down, status, up, update
from controlplane.cli.snapshot import snapshot
from proxy.cli import proxy_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="sluice", prog_name="sluice")
def cli() -> None:
    """sluice: serve one endpoint in front of many replicas, with gap-free updates.

    \b
    Quick start:
      sluice run examples/echo.yaml        # redis, controller, proxy, replicas; Ctrl-C stops
      sluice status                        # in another terminal
    """


for _command in (run, up, update, down, status, replica, snapshot, logs, controller,
                 dashboard):
    cli.add_command(_command)
cli.add_command(proxy_command, name="proxy")


def main() -> None:
    """The `sluice` console script."""
    cli(auto_envvar_prefix="SLUICE")
