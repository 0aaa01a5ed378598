"""The boundary: YAML text or a mapping in, a ServiceSpec or one SpecError out.

`load_spec` reads a file or YAML text (refusing duplicate keys, self-containing
aliases and alias bombs), `parse_spec` validates a mapping: --env / --secret
overrides, `$VAR` substitution as SkyPilot does it, then the structs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import yaml

from controlplane.servicespec.errors import SpecError, translate
from controlplane.servicespec.schema import ServiceSpec, round_trip
from controlplane.servicespec.skyserve_rules import reject_unsupported


def load_spec(
    path_or_text: str | os.PathLike[str],
    *,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """Load a service YAML from a file or from YAML text.

    A PathLike is always a file. A str is YAML text when it holds a newline
    or starts with "{" (flow style), otherwise a file path. `envs` and
    `secrets` override the YAML's (the CLI's --env / --secret), see `parse_spec`.
    """
    if isinstance(path_or_text, str) and (
        "\n" in path_or_text or path_or_text.lstrip().startswith("{")
    ):
        text, source = path_or_text, None
    else:
        source = os.fspath(path_or_text)
        try:
            with open(os.path.expanduser(source), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError("$", f"cannot read the file ({exc})", source=source) from exc
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        raise SpecError("$", _yaml_reason(exc), source=source) from exc
    except RecursionError as exc:
        raise SpecError("$", "invalid YAML: nested too deeply", source=source) from exc
    return parse_spec(data, source=source, envs=envs, secrets=secrets)


def parse_spec(
    mapping: Mapping[str, Any],
    *,
    source: str | None = None,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """Validate a parsed service YAML (a mapping) into a ServiceSpec.

    As SkyPilot's `Task.from_yaml_config`: `envs` / `secrets` (the CLI's --env,
    --secret) override the YAML's entries of the same name (so a YAML may leave
    a value empty for the command line to fill), then `$VAR` / `${VAR}` in
    `service`, `file_mounts`, `workdir` and `volumes` are replaced by the
    value of that env or secret (`fill_in_env_vars`).
    """
    if not isinstance(mapping, Mapping):
        kind = "nothing" if mapping is None else type(mapping).__name__
        raise SpecError(
            "$",
            f"expected a mapping (a service YAML with a `service:` section), got {kind}",
            source=source,
        )
    data = dict(mapping)
    reject_unsupported(data, source)
    for key, overrides in (("envs", envs), ("secrets", secrets)):
        if overrides and (data.get(key) is None or isinstance(data.get(key), Mapping)):
            data[key] = {**(data.get(key) or {}), **overrides}
        if isinstance(data.get(key), Mapping):
            data[key] = _env_values(data[key], key, source)
    values = {
        name: value
        for key in ("envs", "secrets")  # a secret wins over an env of the same name
        if isinstance(data.get(key), Mapping)
        for name, value in data[key].items()
        if isinstance(name, str) and isinstance(value, str)
    }
    for key in _SUBSTITUTED:
        if data.get(key) is not None and values:
            data[key] = fill_in_env_vars(data[key], values)
    try:
        return round_trip(msgspec.convert(data, ServiceSpec))
    except msgspec.ValidationError as exc:
        raise translate(str(exc), data, source, ServiceSpec) from exc
    except (TypeError, msgspec.EncodeError) as exc:
        raise SpecError("$", f"cannot be stored as JSON ({exc})", source=source) from exc


#: Sections where `$VAR` is replaced, as in SkyPilot's Task.from_yaml_config.
_SUBSTITUTED = ("file_mounts", "service", "workdir", "volumes")
# SkyPilot's pattern (sky/task.py `_fill_in_env_vars`), ASCII as its JSON text is.
_ENV_VAR = re.compile(r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?", re.ASCII)


def fill_in_env_vars(value: Any, values: Mapping[str, str]) -> Any:
    """`value` with `$NAME` and `${NAME}` replaced by `values[NAME]` in every string
    (mapping keys too); names not in `values` are left as they are.

    SkyPilot 0.14.1 (`sky/task.py`, `_fill_in_env_vars`) runs the same regex over
    the section dumped as JSON text and parses the result back, which breaks on a
    value holding a quote or a backslash; replacing inside each string gives the
    same result without that failure.
    """
    match value:
        case str():
            return _ENV_VAR.sub(lambda m: values.get(m[1], m[0]), value)
        case Mapping():
            return {
                fill_in_env_vars(k, values) if isinstance(k, str) else k: fill_in_env_vars(
                    v, values
                )
                for k, v in value.items()
            }
        case list():
            return [fill_in_env_vars(item, values) for item in value]
    return value


def _env_values(envs: Mapping[Any, Any], key: str, source: str | None) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, value in envs.items():
        path = f"$.{key}.{name}"
        match value:
            case None:
                flag = "--env" if key == "envs" else "--secret"
                raise SpecError(
                    path,
                    f"has no value; pass it with {flag} {name}=VALUE ({flag} {name} takes "
                    f"${name} from this shell; or {flag}-file FILE), or give it one in the "
                    f"YAML ({name}: \"\" for empty)",
                    source=source,
                )
            case bool():
                raise SpecError(
                    path, f"is a boolean; quote it ('{str(value).lower()}')", source=source
                )
            case int() | float():
                out[name] = str(value)
            case _:
                out[name] = value
    return out


_MAX_YAML_VALUES = 100_000


def _load_yaml(text: str) -> Any:
    """safe_load, refusing what PyYAML lets through: duplicate keys (it keeps
    the last), aliases that contain themselves, alias bombs."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        _check_node(root, set(), {})
    return yaml.safe_load(text)


def _check_node(node: yaml.Node, active: set[int], sizes: dict[int, int]) -> int:
    """Raise on a bad node below `node`; return its value count, aliases expanded."""
    if id(node) in sizes:  # an alias to a node already checked
        return sizes[id(node)]
    if id(node) in active:
        raise yaml.MarkedYAMLError(problem="an alias contains itself", problem_mark=node.start_mark)
    active.add(id(node))
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen: set[tuple[str, str]] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in seen:
                    raise yaml.MarkedYAMLError(
                        problem=f"duplicate key {key.value!r}", problem_mark=key.start_mark
                    )
                seen.add((key.tag, key.value))
            size += _check_node(key, active, sizes) + _check_node(value, active, sizes)
    elif isinstance(node, yaml.SequenceNode):
        size += sum(_check_node(item, active, sizes) for item in node.value)
    active.discard(id(node))
    if size > _MAX_YAML_VALUES:
        raise yaml.MarkedYAMLError(
            problem=f"more than {_MAX_YAML_VALUES} values once aliases are expanded",
            problem_mark=node.start_mark,
        )
    sizes[id(node)] = size
    return size


def _yaml_reason(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = ", ".join(str(part) for part in (exc.context, exc.problem) if part)
        return f"invalid YAML: {what} (line {mark.line + 1}, column {mark.column + 1})"
    return f"invalid YAML: {exc}"
