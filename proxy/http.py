"""HTTP/1.1 wire pieces shared by both sides of the proxy: header rules, status lines,
the proxy's own error responses. Everything here is computed once at import.
"""

from __future__ import annotations

from http import HTTPStatus

# Hop-by-hop headers (RFC 9110 7.6.1) plus the de-facto ones; headers named in
# `Connection:` are hop-by-hop too and are removed per message.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Request headers the proxy sets itself and so never forwards as received. A client's
# Forwarded and X-Real-IP would be trusted by the replica as the proxy's word: dropped.
REQUEST_DROP = HOP_BY_HOP | {b"host", b"expect", b"x-forwarded-proto", b"x-forwarded-host",
                             b"x-real-ip", b"forwarded"}

# Underscore spellings of the headers the proxy decides itself. A CGI/WSGI replica reads
# `X_Real_IP` and `X-Real-IP` as the same HTTP_X_REAL_IP, so a client's `X_Forwarded_For`
# would pass for the proxy's word: a header whose name, `_` read as `-`, is one of these is
# dropped (other underscored names pass, unlike nginx's drop-them-all default).
UNDERSCORE_DROP = REQUEST_DROP | {b"x-forwarded-for", b"content-length"}

# Connection tokens that never remove a header: framing and Host are the proxy's to decide
# (`Connection: content-length` would otherwise unframe a body and smuggle it as a request).
NOT_NAMEABLE = frozenset({b"keep-alive", b"close", b"content-length", b"transfer-encoding",
                          b"host"})

CRLF = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CONTINUE_100 = b"HTTP/1.1 100 Continue\r\n\r\n"

_STATUS_LINES: dict[int, bytes] = {}


def status_line(code: int) -> bytes:
    line = _STATUS_LINES.get(code)
    if line is None:
        try:
            reason = HTTPStatus(code).phrase
        except ValueError:
            reason = "Unknown"
        line = b"HTTP/1.1 %d %s\r\n" % (code, reason.encode("latin-1"))
        _STATUS_LINES[code] = line
    return line


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def connection_tokens(value: bytes) -> set[bytes]:
    return {t.strip().lower() for t in value.split(b",") if t.strip()}


def drop_named_hop(lines: list[bytes], connection: bytes, first: int = 0) -> list[bytes]:
    """`lines` without the header lines (from index `first` on) that `connection` (every
    `Connection:` value of the message, comma-joined) names hop-by-hop (RFC 9110 7.6.1),
    framing headers excepted; the same list when it names none. Both directions of the
    request path use it: the request head and the relayed response head."""
    named = connection_tokens(connection) - NOT_NAMEABLE
    if not named:
        return lines
    return lines[:first] + [
        line for line in lines[first:] if line.split(b":", 1)[0].lower() not in named
    ]


def error_response(code: int, error: str, detail: str, *, close: bool,
                   retry_after: int | None = None) -> bytes:
    """A complete proxy-generated response with a small JSON body (no internals)."""
    body = b'{"error":"%s","detail":"%s"}' % (error.encode(), detail.encode())
    head = [status_line(code), b"Content-Type: application/json\r\n",
            b"Content-Length: %d\r\n" % len(body)]
    if retry_after is not None:
        head.append(b"Retry-After: %d\r\n" % retry_after)
    if close:
        head.append(b"Connection: close\r\n")
    head.append(CRLF)
    return b"".join(head) + body


# Proxy-generated responses, built once; those with `close=True` end the connection.
NO_REPLICA = error_response(503, "no_ready_replica",
                            "no replica became ready within the wait", close=False,
                            retry_after=1)
DEADLINE = error_response(504, "deadline_exceeded",
                          "no response headers within the retry deadline", close=False)
BAD_REQUEST = error_response(400, "bad_request", "malformed or ambiguous request", close=True)
TOO_LARGE = error_response(413, "payload_too_large", "request body exceeds --max-body",
                           close=True)
HEADERS_TOO_LARGE = error_response(431, "request_header_fields_too_large",
                                   "request headers exceed the proxy's limits", close=True)
BAD_HOST = error_response(400, "bad_request", "a request needs exactly one valid Host header",
                          close=True)
BAD_TARGET = error_response(400, "bad_request", "unsupported request target", close=True)
REQUEST_TIMEOUT = error_response(408, "request_timeout",
                                 "the request body stalled for --stream-idle-timeout", close=True)
VERSION_REFUSED = error_response(505, "http_version_not_supported",
                                 "only HTTP/1.0 and HTTP/1.1 are served", close=True)
EXPECT_REFUSED = error_response(417, "expectation_failed",
                                "only Expect: 100-continue is supported", close=True)
HOLD_FULL = error_response(503, "overloaded", "too many requests held for a ready replica",
                           close=False, retry_after=1)
HOLD_FULL_CLOSE = error_response(503, "overloaded", "too many requests held for a ready "
                                 "replica", close=True, retry_after=1)
UPGRADE_REFUSED = error_response(501, "upgrade_not_supported",
                                 "protocol upgrades (WebSocket, CONNECT) are not proxied",
                                 close=True)


# A held `stream: true` request (--hold-heartbeat): the proxy answers 200 with an
# event stream at once and sends SSE comments until a replica takes over the body.
SSE_HOLD_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
SSE_HEARTBEAT = b": sluice: waiting for a ready replica\n\n"


_SSE_ERROR_NAMES = {502: "bad_gateway", 503: "no_ready_replica", 504: "deadline_exceeded"}


def sse_error(status: int, error: str | None = None) -> bytes:
    """The SSE event that ends a held stream the proxy could not serve."""
    name = error or _SSE_ERROR_NAMES.get(status, "proxy_error")
    return b'event: error\ndata: {"error":"%s","status":%d}\n\n' % (name.encode(), status)


def bad_gateway(error_class: str) -> bytes:
    return error_response(502, "bad_gateway", f"all attempts failed; last error: {error_class}",
                          close=False)
