"""`sluice replica add|remove|preempt`: external replicas, and simulated preemption."""

from __future__ import annotations

from pathlib import Path

import click

from controlplane import ops
from controlplane.cli.common import check_url, redis_options, target_of, with_store


@click.group()
def replica() -> None:
    """Register or remove external replicas (the controller probes them, never runs them)."""


@replica.command("add")
@click.argument("name")
@click.argument("url", callback=check_url)
@click.option("--accelerator", metavar="NAME[:COUNT]", help="e.g. A100:1; used by "
              "instance_aware_least_load to look up the target QPS.")  # fmt: skip
@click.option("--spot", is_flag=True, help="The replica runs on a spot instance.")
@redis_options()
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
    target = target_of(redis_url, prefix, state_dir)
    replica_id = with_store(
        target,
        lambda store: ops.add_replica(store, name, url, accelerator=accelerator, spot=spot),
    )
    click.echo(f"{name}: replica {replica_id} at {url.rstrip('/')} registered; "
               "it is routed once its readiness probe passes")  # fmt: skip


@replica.command("remove")
@click.argument("name")
@click.argument("url", callback=check_url)
@redis_options()
def replica_remove(
    name: str, url: str, redis_url: str | None, prefix: str, state_dir: Path
) -> None:
    """Take the external replica at URL out of service NAME (it is not stopped).

    \b
    Example:
      sluice replica remove llm http://10.0.0.7:8000
    """
    target = target_of(redis_url, prefix, state_dir)
    with_store(target, lambda store: ops.remove_replica(store, name, url))
    click.echo(f"{name}: replica at {url.rstrip('/')} removed from the ready set")


@replica.command("preempt")
@click.argument("name")
@click.argument("replica_id", metavar="ID", type=click.IntRange(1))
@redis_options()
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
    target = target_of(redis_url, prefix, state_dir)
    with_store(target, lambda store: ops.preempt_replica(store, name, replica_id))
    click.echo(f"{name}: replica {replica_id} preempted; the controller replaces it")
