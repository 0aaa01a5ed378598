"""The service spec: a Sky Serve service YAML, parsed and validated.

A sluice spec is a Sky Serve service YAML as is: the `service:` section field
for field (Sky Serve's names, defaults and validation rules) plus the task
fields a replica backend needs. It is parsed into frozen msgspec Structs whose
shape mirrors the YAML, so every error names the YAML path of the field, e.g.
`$.service.replica_policy.max_replicas: must be >= min_replicas (2), got 1`.

Entry points: `load_spec(path_or_text)` and `parse_spec(mapping)`. They raise
one error type, `SpecError`; msgspec and YAML errors are translated there and
nowhere else. A parsed spec is stored in Redis as JSON (`to_json` /
`ServiceSpec.from_json`); `parse_spec` returns the JSON round trip of what it
validated, so the spec a caller holds equals the spec every reader decodes.

Deliberate differences from Sky Serve: `target_qps_per_replica` must be > 0
(0 makes the autoscaler divide by zero); per-accelerator keys may hold hyphens
("A100-80GB:1"); multi-port `resources.ports` without `service.ports` is an
error but no port at all is fine (the local backend picks one and sets PORT);
`p2c` and `prefix` are extra policies, `target_ongoing_requests` an extra
autoscaling signal (concurrency, fed by the proxies), and `service.sluice`
holds sluice-only options (`service.sluice.prefix`: the prefix policy's); a
Sky Serve YAML never has it, and it is optional.

Modules, in import order (each imports only those before it):
    errors    SpecError; msgspec's messages translated into it
    service   the `service:` section's structs, Sky Serve's defaults, policy names
    schema    ServiceSpec (the whole YAML), resources, port ranges, the JSON codec
    compat    Sky Serve compatibility: refused keys, the count-only-change rule
    load      load_spec / parse_spec: YAML in, env substitution, one SpecError out

This package re-exports only what callers outside it use; the rest (the defaults,
the field types, PortSpec, Resources, ServiceSection...) is imported from the module
that defines it.

It imports msgspec, PyYAML and the wire contract (policy names, PrefixOptions), nothing
else of sluice: scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""

from controlplane.servicespec.errors import SpecError
from controlplane.servicespec.load import fill_in_env_vars, load_spec, parse_spec
from controlplane.servicespec.schema import ServiceSpec, port_ranges
from controlplane.servicespec.service import ReadinessProbe, ReplicaPolicy
from controlplane.servicespec.skyserve_rules import is_count_only_change

__all__ = [
    "ReadinessProbe",
    "ReplicaPolicy",
    "ServiceSpec",
    "SpecError",
    "fill_in_env_vars",
    "is_count_only_change",
    "load_spec",
    "parse_spec",
    "port_ranges",
]
