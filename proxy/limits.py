"""Process limits the proxy sets for itself: the file-descriptor limit and what it allows.

Every proxied stream holds two descriptors (the client's socket and a pooled one to
the replica), so the connection cap follows the descriptor limit: the soft
RLIMIT_NOFILE is raised to the hard limit at start (systemd's default soft limit is
1024: about 500 streams), and --max-connections is lowered to what the limit leaves.
"""

from __future__ import annotations

import resource

# Descriptors kept aside from client and pool sockets: listeners, Redis, admin, logs.
RESERVED_FDS = 128
_CAP_WHEN_UNLIMITED = 1 << 20  # hard limit "unlimited" (macOS): ask for this much


def raise_nofile() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the (soft, hard) in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _CAP_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # macOS refuses above OPEN_MAX: keep what we have
            return soft, hard
        soft = want
    return soft, hard


def connection_cap(configured: int) -> int:
    """The client connections this process can hold: `configured`, or less when the soft
    descriptor limit cannot hold two descriptors for each."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, (soft - RESERVED_FDS) // 2))
