"""The optional access log (`sluice-proxy --access-log PATH`, off by default): one line
per request, in nginx's `combined` format plus three fields:

    $remote_addr - - [$time_local] "$request" $status $bytes "-" "$http_user_agent"
        $request_time $upstream $cut

(one line; shown wrapped). `$request` is the method, the path *without its query
string* (query strings carry API keys) and the protocol; `$status` is what the client
got (499: the client went away first); `$bytes` the response body bytes relayed from
the replica (0 for the proxy's own answers: 502, 503, 504 ...); the referer is always
"-" (not kept); `$request_time` seconds from the request head to the end, with
millisecond resolution; `$upstream` the replica's URL ("-": none); `$cut` the cause
of a response cut short (proxy/cuts.py), "-" when it completed. A tool that reads
nginx's combined format reads the first nine fields as such.

Lines are buffered in memory and written by the sweeper's tick (every 100 ms) or when
64 KiB are waiting, with one `write` on a file opened O_APPEND (workers of one proxy
may share the file: each write lands whole). `-` writes to stderr. Off (the default),
the request path pays one `is None` test per request.
"""

from __future__ import annotations

import os
import re
import time

_FLUSH_BYTES = 64 * 1024
_UNSAFE = re.compile(rb'[^\x20-\x7e]|["\\]')
# Deleting every safe byte leaves the unsafe ones: a C-speed test for "needs escaping".
_SAFE = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')


def _escape(value: bytes) -> bytes:
    """nginx's escaping of logged strings: `"`, `\\` and non-printables as \\xHH."""
    return _UNSAFE.sub(lambda m: b"\\x%02X" % m.group()[0], value)


def request_line(head_line: bytes) -> bytes:
    """'GET /v1/x?key=1 HTTP/1.1' -> 'GET /v1/x HTTP/1.1' (escaped, the path at most
    2 KiB). The common line (no query, nothing to escape) is returned as it is."""
    line = head_line.rstrip(b"\r\n")
    query = line.find(b"?")
    if query >= 0:
        space = line.rfind(b" ")
        line = line[:query] + line[space:] if space > query else line[:query]
    if len(line) > 2100:
        method, _, rest = line.partition(b" ")
        target, _, proto = rest.rpartition(b" ")
        line = b"%s %s %s" % (method, target[:2048], proto) if target else line[:2100]
    if line.translate(None, _SAFE):
        line = _escape(line)
    return line


class AccessLog:
    """One process's access log; `open()` first, `close()` last."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._lines: list[bytes] = []
        self._size = 0
        self._second = -1
        self._stamp = b""

    def open(self) -> None:
        if self.path == "-":
            self._fd = 2
        else:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def record(self, peer: bytes, head_line: bytes, headers: list[tuple[bytes, bytes]],
               status: int, sent: int, seconds: float, upstream: str | None,
               cut: str | None) -> None:  # fmt: skip
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%d/%b/%Y:%H:%M:%S %z", time.localtime(now)).encode()
        agent = b"-"
        for name, value in headers:
            if len(name) == 10 and name.lower() == b"user-agent":
                agent = value[:512]
                if agent.translate(None, _SAFE):
                    agent = _escape(agent)
                break
        line = b'%s - - [%s] "%s" %d %d "-" "%s" %.3f %s %s\n' % (
            peer or b"-", self._stamp, request_line(head_line), status, sent, agent,
            seconds, (upstream or "-").encode(), (cut or "-").encode())  # fmt: skip
        self._lines.append(line)
        self._size += len(line)
        if self._size >= _FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._lines or self._fd < 0:
            return
        data = b"".join(self._lines)
        self._lines.clear()
        self._size = 0
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError:
            pass  # a full disk must not take the proxy down; the lines are dropped

    def close(self) -> None:
        self.flush()
        if self._fd > 2:
            os.close(self._fd)
        self._fd = -1
