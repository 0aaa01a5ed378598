"""Free 127.0.0.1 ports for tests: the one helper every test and fixture uses.

`free_port(count=1)`: the first of `count` consecutive ports that nothing listens on
now and that this process has not handed out before (so two fixtures in one test never
get the same port). A port nothing listens on is also what a test wants for a
"connection refused" address.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"

_handed_out: set[int] = set()


def free_port(count: int = 1) -> int:
    """A port on 127.0.0.1 (the first of ``count`` consecutive ones) that nothing listens on
    now and that this process has not handed out before."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port: int = s.getsockname()[1]
        ports = range(port, port + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(p) for p in ports[1:]):
            _handed_out.update(ports)
            return port
    raise RuntimeError("no free port found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True
