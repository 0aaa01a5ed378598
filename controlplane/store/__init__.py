"""The only control-plane code that reads or writes sluice's Redis keys (the keys are
named once, in proxy/wire/keys.py; the leader lease is one object,
`controlplane.lease.Lease`, which `Store.lease(holder, ttl)` makes).

    facade.py     `Store`: the one object callers use; thin, delegating to:
    codec.py      records as hashes and JSON; `same_ready_set` (does a commit publish?)
    commit.py     the WATCH/MULTI/EXEC transaction: commit, commit_with, register and
                  unregister; op-id idempotency; the fencing check
    telemetry.py  events, request rates, in-flight counts, proxy heartbeats, autoscaler
    pubsub.py     the control channel (nudges); `Store.follow_snapshots` is in facade.py

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
