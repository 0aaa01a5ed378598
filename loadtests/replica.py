"""A stand-in for a busy model server, for the load tests: stdlib only.

    python loadtests/replica.py --port 8001 [--load-seconds 3] [--health-delay 1]

- `POST /v1/chat/completions`: an OpenAI-style chat completion. With
  `"stream": true` the reply is Server-Sent Events (`data: {chunk}` per token,
  then `data: [DONE]`) in HTTP/1.1 chunks, one token every `--token-delay`
  seconds; without it, one `chat.completion` JSON after the same total time.
  `max_tokens` (default `--tokens`) sets the length. Like vLLM, with
  `continue_final_message: true` a final assistant message is continued: the
  answer goes on after its words (the stock text is positional), and only the new
  tokens are sent (what a proxy resuming a cut stream asks for, docs/resume.md).
- `GET /health` (the readiness path): 503 while the "model loads" for the first
  `--load-seconds`, then 200; every answer takes `--health-delay` seconds, like
  a server busy generating (so a probe is slow and a fresh replica needs a
  while to become READY).
- Any other GET: a small JSON at once.

Every answer carries `X-Replica-Id` (`--id`, default `$SLUICE_REPLICA_ID`) and
`X-Replica-Version` (`--version`), so a load test sees who served it.
Options default from env vars (`REPLICA_LOAD_SECONDS`, `REPLICA_HEALTH_DELAY`,
`REPLICA_TOKEN_DELAY`, `REPLICA_TOKENS`, `REPLICA_VERSION`; `PORT`), so a service
YAML can set them in `envs:`. SIGTERM: stop accepting, let requests in flight
finish (up to `--grace` seconds; answers then carry `Connection: close`, so
keep-alive connections a proxy holds end too), exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STOCK = (
    "sluice keeps the endpoint answering while replicas come and go , "
    "and no request is lost while the fleet changes under steady load ."
).split()


class Replica(ThreadingHTTPServer):
    """The server plus the settings its handlers read and its in-flight count."""

    daemon_threads = True  # idle keep-alive connections must not hold up the exit
    # socketserver's default listen backlog is 5: a proxy releasing a burst of held
    # requests to a fresh replica would see SYNs dropped and connects stall for seconds.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], args: argparse.Namespace) -> None:
        super().__init__(address, Handler)
        self.args = args
        self.started = time.monotonic()
        self.in_flight = 0
        self.idle = threading.Condition()
        # Set on SIGTERM: answers say `Connection: close`, so keep-alive connections end
        # after the request on them and the drain ends (a proxy's pool may hold them).
        self.stopping = threading.Event()

    def loaded(self) -> bool:
        return time.monotonic() - self.started >= self.args.load_seconds

    def begin(self) -> None:
        with self.idle:
            self.in_flight += 1

    def end(self) -> None:
        with self.idle:
            self.in_flight -= 1
            self.idle.notify_all()

    def wait_idle(self, timeout: float) -> None:
        with self.idle:
            self.idle.wait_for(lambda: self.in_flight == 0, timeout=timeout)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sluice-loadtest-replica/1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server: Replica

    def do_GET(self) -> None:
        self.server.begin()
        try:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                time.sleep(self.server.args.health_delay)
                if self.server.loaded():
                    self._json(200, {"status": "ok"})
                else:
                    self._json(503, {"status": "loading"})
            elif path == "/v1/models":
                model = {"id": "sluice/loadtest", "object": "model"}
                self._json(200, {"object": "list", "data": [model]})
            else:
                self._json(200, {"path": path})
        finally:
            self.server.end()

    def do_POST(self) -> None:
        self.server.begin()
        try:
            self._post()
        finally:
            self.server.end()

    def _post(self) -> None:
        body = self._body()
        if self.path.split("?", 1)[0] != "/v1/chat/completions":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            request = json.loads(body or b"{}")
            count = int(request.get("max_tokens") or self.server.args.tokens)
            stream = bool(request.get("stream"))
            start = _continued_words(request)
        except (ValueError, TypeError, AttributeError) as exc:
            self._json(400, {"error": {"message": f"bad request: {exc}"}})
            return
        tokens = [STOCK[i % len(STOCK)] + " "
                  for i in range(start, start + max(1, min(count, 4096)))]
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        if stream:
            self._stream(completion_id, tokens)
            return
        time.sleep(self.server.args.token_delay * len(tokens))
        message = {"role": "assistant", "content": "".join(tokens)}
        self._json(200, {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "sluice/loadtest",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"completion_tokens": len(tokens)},
        })  # fmt: skip

    def _stream(self, completion_id: str, tokens: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self._identify()
        self.end_headers()
        try:
            for i, token in enumerate(tokens):
                delta = {"role": "assistant", "content": token} if i == 0 else {"content": token}
                self._event(completion_id, delta, None)
                time.sleep(self.server.args.token_delay)
            self._event(completion_id, {}, "stop")
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")  # the last chunk: end of the body
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: stop generating

    def _event(self, completion_id: str, delta: dict[str, str], finish: str | None) -> None:
        payload = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "sluice/loadtest",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._identify()
        self.end_headers()
        self.wfile.write(data)

    def _identify(self) -> None:
        self.send_header("X-Replica-Id", self.server.args.id)
        self.send_header("X-Replica-Version", self.server.args.version)
        if self.server.stopping.is_set():
            self.send_header("Connection", "close")
            self.close_connection = True

    def _body(self) -> bytes:
        """The request body, by Content-Length or chunked (the proxy may stream it)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after each chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would flood the replica log


def _continued_words(request: dict[str, Any]) -> int:
    """Words already in the final assistant message a request asks to continue (else 0)."""
    messages = request.get("messages") or []
    if request.get("continue_final_message") and messages and \
            messages[-1].get("role") == "assistant":
        return len(str(messages[-1].get("content") or "").split())
    return 0


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    parser.add_argument("--id", default=_env("SLUICE_REPLICA_ID", "-"))
    parser.add_argument("--version", default=_env("REPLICA_VERSION", "1"))
    parser.add_argument(
        "--load-seconds", type=float, default=float(_env("REPLICA_LOAD_SECONDS", "3")),
        help="/health answers 503 this long after start (the model loading)",
    )  # fmt: skip
    parser.add_argument(
        "--health-delay", type=float, default=float(_env("REPLICA_HEALTH_DELAY", "1")),
        help="seconds every /health answer takes",
    )  # fmt: skip
    parser.add_argument(
        "--token-delay", type=float, default=float(_env("REPLICA_TOKEN_DELAY", "0.02")),
        help="seconds between streamed tokens",
    )  # fmt: skip
    parser.add_argument(
        "--tokens", type=int, default=int(_env("REPLICA_TOKENS", "16")),
        help="tokens per completion when the request has no max_tokens",
    )  # fmt: skip
    parser.add_argument("--grace", type=float, default=10.0, help="SIGTERM drain, seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    server = Replica((args.host, args.port), args)

    def on_sigterm(signum: int, frame: object) -> None:
        if not server.stopping.is_set():
            server.stopping.set()
            # shutdown() waits for serve_forever to return: not from its own thread.
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"replica {args.id} (v{args.version}) on {args.host}:{args.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()  # stop accepting; then let what was accepted finish
        print(f"{time.time():.3f} replica {args.id}: SIGTERM, {server.in_flight} in flight",
              flush=True)  # fmt: skip
        server.wait_idle(args.grace)
    print(f"{time.time():.3f} replica {args.id}: stopped, {server.in_flight} in flight",
          flush=True)  # fmt: skip
    sys.exit(0)


if __name__ == "__main__":
    main()
