"""A stdlib replica whose readiness path is slow: `/health` answers 200 after
`--health-delay` seconds (default 2). Every other GET answers 200 at once with
`X-Replica-Id` (the --id) and `X-Replica-Pid`, so a test sees who served it.

    python -m tests.support.slow_health_replica --port P [--id ID] [--health-delay S]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(replica_id: str, health_delay: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path.startswith("/health"):
                time.sleep(health_delay)
                body = b"ok\n"
            else:
                body = b"hello from " + replica_id.encode() + b"\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Replica-Id", replica_id)
            self.send_header("X-Replica-Pid", str(os.getpid()))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per request would flood the replica log

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--id", default=None)
    parser.add_argument("--health-delay", type=float, default=2.0)
    args = parser.parse_args()
    server = ThreadingHTTPServer(
        (args.host, args.port), make_handler(args.id or str(args.port), args.health_delay)
    )
    server.daemon_threads = True

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"serving on {args.host}:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.1)
    server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
