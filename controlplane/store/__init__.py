"""The only control-plane code that reads or writes sluice's Redis keys (the keys are
named once, in proxy/wire/keys.py). Callers use one `Store` and the objects it binds:
`store.telemetry` and `store.lease(holder, ttl)`.

    facade.py     `Store`: the reads of the records and events, `commit` (and its kin),
                  `follow_snapshots`, the control channel; makes the bound objects:
    telemetry.py  `Telemetry` (`store.telemetry`): request rates, in-flight counts,
                  proxy heartbeats, engine views, autoscaler decisions
    codec.py      records as hashes and JSON; `same_ready_set` (does a commit publish?)
    commit.py     the WATCH/MULTI/EXEC transaction: commit, commit_with, register and
                  unregister; op-id idempotency; the fencing check
    untrusted.py  the bounded read and decoders of what proxies write
    pubsub.py     the control channel (nudges)
    (the leader lease, `controlplane.lease.Lease`, is `Store.lease`'s)

Callers import from here: `from controlplane.store import Store, Mutation, StoreError`.
The errors are defined in controlplane/errors.py (shared with the lease) and re-exported.

What it may import (nothing in the control plane above it):
scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""

from controlplane.errors import (
    CommitConflict,
    LeaseLost,
    RecordInvalid,
    ServiceExists,
    ServiceNotFound,
    StoreError,
    StoreUnavailable,
)
from controlplane.store.codec import decode_service_record, encode_service_record
from controlplane.store.commit import Committed, Mutation, MutationPlan
from controlplane.store.facade import Store
from controlplane.store.pubsub import ControlSubscription

__all__ = [
    "CommitConflict",
    "Committed",
    "ControlSubscription",
    "LeaseLost",
    "Mutation",
    "MutationPlan",
    "RecordInvalid",
    "ServiceExists",
    "ServiceNotFound",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "decode_service_record",
    "encode_service_record",
]
