"""`--dry-run` of `sluice up`, `update` and `run`: the validated spec, normalised (every
default filled in, `$VAR` replaced) with secrets redacted, and what the command would
start. Nothing here touches Redis or starts a process.
"""

from __future__ import annotations

from typing import Any

import click
import msgspec
import yaml

from controlplane.backends.fixedport import fixed_port
from controlplane.servicespec import ServiceSpec

REDACTED = "<redacted>"


def normalised(spec: ServiceSpec) -> dict[str, Any]:
    """The spec as plain data, secrets redacted: their values, and wherever a secret's
    value was substituted (`$TOKEN` in a probe header)."""
    data: dict[str, Any] = msgspec.to_builtins(spec)
    values = sorted((v for v in spec.secrets.values() if v), key=len, reverse=True)
    data = _redact(data, values)
    data["secrets"] = {name: REDACTED for name in spec.secrets}
    return data


def _redact(value: Any, secrets: list[str]) -> Any:
    match value:
        case str():
            for secret in secrets:
                value = value.replace(secret, REDACTED)
            return value
        case dict():
            return {_redact(k, secrets): _redact(v, secrets) for k, v in value.items()}
        case list():
            return [_redact(item, secrets) for item in value]
    return value


def _shown(value: Any) -> Any:
    """Without the unset fields (None, {}): what is left is what the spec says. User maps
    keep theirs (`accelerators: {L4:1: null}` is a name without a count)."""
    if isinstance(value, dict):
        return {k: v if k in _AS_GIVEN else _shown(v) for k, v in value.items()
                if v is not None and v != {}}  # fmt: skip
    return value


_AS_GIVEN = frozenset({"accelerators", "envs", "secrets", "headers", "post_data", "any_of",
                       "ordered", "file_mounts", "config", "volumes", "labels"})  # fmt: skip


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (run, setup) as YAML literal blocks, as a user writes them."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def replicas_text(spec: ServiceSpec) -> str:
    scaling = spec.service.scaling
    if spec.autoscaling:
        count = f"{spec.min_replicas} to {spec.max_replicas} replicas (autoscaled)"
    else:
        count = f"{spec.min_replicas} replica{'s' if spec.min_replicas != 1 else ''}"
    if scaling.num_overprovision:
        count += f" + {scaling.num_overprovision} overprovisioned"
    return count


def replica_text(spec: ServiceSpec, backend: str) -> str:
    """How one replica would run on `backend`."""
    probe = spec.probe
    method = "POST" if probe.post_data is not None else "GET"
    check = (f"probed with {method} {probe.path} every {probe.endpoint_probe_interval_seconds:g}s"
             f" (initial delay {probe.initial_delay_seconds:g}s)")  # fmt: skip
    if backend == "skypilot":
        nodes = f", {spec.num_nodes} nodes" if spec.num_nodes > 1 else ""
        return f"run each replica as a SkyPilot cluster{nodes} serving on port " \
               f"{spec.replica_port}; {check}"  # fmt: skip
    port = fixed_port(spec)
    where = f"on the fixed port {port}" if port is not None else "on a free port in $PORT"
    setup = "; setup once per version" if spec.setup else ""
    return f"run each replica as a local process (bash -c run) {where}{setup}; {check}"


def show(name: str, naming: str, spec: ServiceSpec, backend: str, doing: list[str]) -> None:
    """Print the dry run: the name, what would happen, the normalised spec."""
    click.echo(f"service name: {name}{naming}")
    click.echo(f"backend: {backend}")
    for line in doing:
        click.echo(f"would {line}")
    click.echo("spec (normalised, secrets redacted):")
    text = yaml.dump(_shown(normalised(spec)), Dumper=_Dumper, sort_keys=False,
                     default_flow_style=False, allow_unicode=True)  # fmt: skip
    click.echo("  " + text.rstrip("\n").replace("\n", "\n  "))
    click.echo("dry run: valid; nothing was started and Redis was not contacted")
