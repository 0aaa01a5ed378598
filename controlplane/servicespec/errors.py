"""`SpecError`, and msgspec's validation messages translated into it: one error naming
the YAML path of the offending field, e.g.
`$.service.replica_policy.max_replicas: must be >= min_replicas (2), got 1`."""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Mapping
from typing import Any

import msgspec


class SpecError(ValueError):
    """An invalid spec. `path` is the YAML path, e.g. `$.service.replicas`."""

    def __init__(self, path: str, reason: str, *, source: str | None = None) -> None:
        self.path = path
        self.reason = reason
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}{path}: {reason}")


_AT = re.compile(r"^(?P<reason>.*?)(?: - at `(?:key` in `)?(?P<path>\$[^`]*)`)?$", re.DOTALL)
_FIELD_PREFIX = re.compile(
    r"^(?P<field>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*): (?P<rest>.*)$", re.DOTALL
)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


def translate(
    message: str, data: Any, source: str | None, root: type[msgspec.Struct]
) -> SpecError:
    """Turn msgspec's "what - at `$.path`" into SpecError(path, reason); `root` is the
    struct the path starts at (for the field names of an "unknown field" hint)."""
    m = _AT.match(message)
    assert m is not None  # the pattern matches any string
    reason, path = m["reason"], m["path"] or "$"
    is_key = " - at `key` in `" in message
    if field := _FIELD_PREFIX.match(reason):  # a __post_init__ naming its field
        return SpecError(f"{path}.{field['field']}", field["rest"], source=source)
    if unknown := _UNKNOWN.match(reason):
        name = unknown["name"]
        fields = _fields_at(root, path)
        hint = difflib.get_close_matches(name, fields, n=1)
        suggestion = (
            f"did you mean `{hint[0]}`?" if hint else f"expected one of: {', '.join(fields)}"
        )
        return SpecError(f"{path}.{name}", f"unknown field; {suggestion}", source=source)
    if missing := _MISSING.match(reason):
        return SpecError(f"{path}.{missing['name']}", "required field is missing", source=source)
    if is_key:
        return SpecError(_bad_key_path(data, path, reason), f"invalid key: {reason}", source=source)
    if path.endswith("[...]"):
        path = _bad_value_path(data, path, reason)
    if reason.startswith("Expected") and ", got " not in reason:
        value = _value_at(data, path)
        if value is not _MISSING_VALUE:
            reason = f"{reason}, got {value!r}"
    return SpecError(path, reason, source=source)


_MISSING_VALUE = object()


def _value_at(data: Any, path: str) -> Any:
    """The input value at a simple `$.a.b` path, for messages."""
    node = data
    for part in path.split(".")[1:]:
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING_VALUE
        node = node[part]
    return node


_JSON_KIND = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}


def _bad_key_path(data: Any, path: str, reason: str) -> str:
    """Name the first key of the mapping at `path` that fails msgspec's regex."""
    mapping = _value_at(data, path)
    pattern = re.search(r"matching regex '(.*)'$", reason)
    if isinstance(mapping, Mapping) and pattern:
        for key in mapping:
            if not isinstance(key, str) or not re.search(pattern[1], key):
                return f"{path}.{key}"
    return path


def _bad_value_path(data: Any, path: str, reason: str) -> str:
    """Replace msgspec's `[...]` (some dict value) by the first key whose
    value has the wrong kind, e.g. `$.service.readiness_probe.headers.X`."""
    mapping = _value_at(data, path.removesuffix("[...]"))
    got = re.search(r", got `(\w+)`$", reason)
    if isinstance(mapping, Mapping) and got:
        for key, value in mapping.items():
            kind = "null" if value is None else _JSON_KIND.get(type(value))
            if kind == got[1]:
                return f"{path.removesuffix('[...]')}.{key}"
    return path


def _fields_at(root: type[msgspec.Struct], path: str) -> list[str]:
    """Field names of the struct at a `$.a.b` path of `root`."""
    cls: type[msgspec.Struct] | None = root
    for part in path.split(".")[1:]:
        if cls is None:
            return []
        by_name = {f.name: f.type for f in msgspec.structs.fields(cls)}
        cls = _struct_in(by_name.get(part))
    return [] if cls is None else [f.name for f in msgspec.structs.fields(cls)]


def _struct_in(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    for arg in typing.get_args(tp):
        if (found := _struct_in(arg)) is not None:
            return found
    return None
