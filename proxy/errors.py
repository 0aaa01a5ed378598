"""The proxy's error tree. Library errors are translated at one boundary.

    SluiceError              (proxy/wire/errors.py, shared with the control plane)
    ├── ConfigError          bad command line or config (startup refuses)
    ├── SnapshotInvalid      a ReadySnapshot payload failed validation (proxy/wire/errors.py)
    └── UpstreamError        one attempt against a replica failed
        └── UpstreamConnectError   could not connect (refused, timeout, TLS)

(A connection lost before response headers is not raised: the Exchange sees it as a
callback and names it "UpstreamResetError" in its 502 detail.)
"""

from __future__ import annotations

from proxy.wire.errors import SluiceError


class ConfigError(SluiceError):
    """Invalid configuration; the message names the option."""


class UpstreamError(SluiceError):
    """One attempt against a replica failed before response headers."""


class UpstreamConnectError(UpstreamError):
    pass

