"""The proxy's error tree. Library errors are translated at one boundary.

    SluiceError
    ├── ConfigError          bad command line or config (startup refuses)
    ├── SnapshotInvalid      a ReadySnapshot payload failed validation
    └── UpstreamError        one attempt against a replica failed
        └── UpstreamConnectError   could not connect (refused, timeout, TLS)

(A connection lost before response headers is not raised: the Exchange sees it as a
callback and names it "UpstreamResetError" in its 502 detail.)
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""


class ConfigError(SluiceError):
    """Invalid configuration; the message names the option."""


class SnapshotInvalid(SluiceError):
    """A ReadySnapshot payload that failed validation; the set is kept."""


class UpstreamError(SluiceError):
    """One attempt against a replica failed before response headers."""


class UpstreamConnectError(UpstreamError):
    pass

