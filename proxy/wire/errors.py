"""The errors both sides of the contract raise.

    SluiceError          base of every error sluice raises on purpose
    └── SnapshotInvalid  a ReadySnapshot payload failed validation (the set is kept)

The proxy's own errors (proxy/errors.py) and the control plane's
(controlplane/errors.py, ops, spec ...) derive from SluiceError.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""


class SnapshotInvalid(SluiceError):
    """A ReadySnapshot payload that failed validation; the set is kept."""
