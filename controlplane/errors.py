"""The errors of the control plane's Redis layer (the tree is drawn in `StoreError`),
and the one boundary where redis-py's errors become them (`redis_errors`).

A module of its own so that both the store (controlplane/store/) and the leader lease
(controlplane/lease.py) raise and catch them without importing each other; callers
import them from `controlplane.store`. Imports only proxy.wire and redis-py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.wire.errors import SluiceError


class StoreError(SluiceError):
    """A Redis operation of the store failed.

    SluiceError (proxy/wire/errors.py)
    └── StoreError
        ├── StoreUnavailable   Redis unreachable or timed out
        ├── ServiceNotFound    no such service
        ├── ServiceExists      register_service of a name already taken
        ├── CommitConflict     too many concurrent writers; the commit gave up
        ├── LeaseLost          a fenced commit found the leader lease held by another
        └── RecordInvalid      a record in Redis does not decode
    """


class StoreUnavailable(StoreError):
    """Redis could not be reached, or did not answer in time."""


class ServiceNotFound(StoreError):
    """The service has no record in Redis."""


class ServiceExists(StoreError):
    """A service of that name is already registered."""


class CommitConflict(StoreError):
    """The commit lost the WATCH race too many times in a row."""


class LeaseLost(StoreError):
    """A fenced store's commit found the leader lease gone or held by someone else."""


class RecordInvalid(StoreError):
    """A record stored in Redis failed to decode (written by hand, or corrupt)."""


@contextlib.contextmanager
def redis_errors() -> Iterator[None]:
    """The one boundary where redis-py's errors become the store's: every Redis call of
    the control plane runs inside it."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise StoreUnavailable(f"redis unavailable: {exc}") from exc
    except RedisError as exc:
        raise StoreError(f"redis error: {exc}") from exc
