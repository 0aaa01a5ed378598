"""Noticing a client that left while its connection's reading is paused.

A request held for a ready replica with its connection's reading paused (a large body
buffered, or pipelined requests queued) never reads the client's FIN: the event loop
stops watching the socket. Without a look, such a request would be sent to a replica
once one is ready, for a client long gone, and its buffers kept until then.

`departed()` looks without reading: one poll(2) for any number of sockets, asking
for POLLRDHUP (the peer shut down its side, even with unread data before the FIN)
on Linux; elsewhere a one-byte MSG_PEEK per socket, which sees the FIN only once
no unread data precedes it. Like nginx's broken-connection check, a client that
half-closes (shutdown(SHUT_WR)) counts as gone.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Sequence
from typing import Protocol, TypeVar

_RDHUP: int | None = getattr(select, "POLLRDHUP", None)


class Watched(Protocol):
    @property
    def transport(self) -> asyncio.Transport | None: ...


def _fileno(conn: Watched) -> int:
    transport = conn.transport
    if transport is None or transport.is_closing():
        return -1
    sock = transport.get_extra_info("socket")
    return -1 if sock is None else int(sock.fileno())


T = TypeVar("T", bound=Watched)


def departed(conns: Sequence[T]) -> list[T]:
    """The connections whose peer has closed or reset (never reads their data)."""
    fds: dict[int, T] = {}
    for conn in conns:
        fd = _fileno(conn)
        if fd >= 0:
            fds[fd] = conn
    if not fds:
        return []
    if _RDHUP is not None:
        poller = select.poll()
        mask = _RDHUP | select.POLLHUP | select.POLLERR
        for fd in fds:
            poller.register(fd, mask)
        return [fds[fd] for fd, events in poller.poll(0) if events & mask]
    gone = []
    for fd, conn in fds.items():
        sock = socket.socket(fileno=fd)
        try:
            if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                gone.append(conn)
        except BlockingIOError:
            pass
        except OSError:
            gone.append(conn)
        finally:
            sock.detach()  # the fd stays the transport's
    return gone
