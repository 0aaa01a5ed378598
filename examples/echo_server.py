"""A stdlib-only HTTP echo server: one sluice (or Sky Serve) replica.

    PORT=8080 python3 echo_server.py

GET /health answers 200 for the readiness probe; any other request is echoed
back as JSON (method, path, body, the replica's id). HTTP/1.1 with
keep-alive, one thread per connection. Listens on HOST (default 0.0.0.0, what
a replica on a cluster needs) and PORT (default 8080); exits cleanly on
SIGTERM. No per-request logging.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

REPLICA_ID = os.environ.get("SLUICE_REPLICA_ID") or os.environ.get("SKYPILOT_SERVE_REPLICA_ID", "")


class EchoHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every response has a length
    server_version = "sluice-echo/1"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/health":
            self._reply(200, {"status": "ok", "replica": REPLICA_ID})
        else:
            self._echo()

    def do_POST(self) -> None:
        self._echo()

    do_PUT = do_PATCH = do_DELETE = do_POST

    def _echo(self) -> None:
        body = read_body(self)
        self._reply(
            200,
            {
                "replica": REPLICA_ID,
                "method": self.command,
                "path": self.path,
                "body": body.decode("utf-8", "replace"),
            },
        )

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Replica-Id", REPLICA_ID)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no per-request logs


def read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body, by Content-Length or chunked (a proxy may stream it)."""
    if "chunked" in handler.headers.get("Transfer-Encoding", "").lower():
        chunks: list[bytes] = []
        while True:
            size = int(handler.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()  # the CRLF after each chunk
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length > 0 else b""


def _exit(signum: int, frame: object) -> NoReturn:
    sys.exit(0)


def main() -> None:
    host = os.environ.get("HOST", "0.0.0.0")
    port = int(os.environ.get("PORT", "8080"))
    server = ThreadingHTTPServer((host, port), EchoHandler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, _exit)
    print(f"echo replica {REPLICA_ID or '-'} listening on {host}:{port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
