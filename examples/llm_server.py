"""A fake streaming "LLM" with an OpenAI-style API, stdlib only.

    PORT=8000 python3 llm_server.py

POST /v1/chat/completions answers with the words of the last user message
(or a stock sentence), one token per TOKEN_DELAY seconds (default 0.02). With
"stream": true the reply is Server-Sent Events, each `data: {...}` a
chat.completion.chunk, ending in `data: [DONE]`, sent as HTTP/1.1 chunks so
the connection stays alive. Without it, one chat.completion JSON.
GET /health answers 503 for the first LOAD_SECONDS (default 0; a model
loading) and 200 after; GET /v1/models lists the one model.
Listens on HOST (default 0.0.0.0) and PORT (default 8000).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

MODEL = os.environ.get("MODEL_NAME", "sluice/fake-llm")
TOKEN_DELAY = float(os.environ.get("TOKEN_DELAY", "0.02"))
LOAD_SECONDS = float(os.environ.get("LOAD_SECONDS", "0"))
REPLICA_ID = os.environ.get("SLUICE_REPLICA_ID") or os.environ.get("SKYPILOT_SERVE_REPLICA_ID", "")
STOCK = "sluice keeps the endpoint answering while replicas come and go ."
STARTED = time.monotonic()


class LLMHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sluice-fake-llm/1"

    def do_GET(self) -> None:
        match self.path.split("?", 1)[0]:
            case "/health":
                if time.monotonic() - STARTED < LOAD_SECONDS:
                    self._json(503, {"status": "loading"})
                else:
                    self._json(200, {"status": "ok", "replica": REPLICA_ID})
            case "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            case _:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = read_body(self)
        if self.path.split("?", 1)[0] != "/v1/chat/completions":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            request = json.loads(body or b"{}")
            tokens = _tokens(request)
        except (ValueError, TypeError, AttributeError) as exc:
            self._json(400, {"error": {"message": f"bad request: {exc}"}})
            return
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        if request.get("stream"):
            self._stream(completion_id, tokens)
        else:
            time.sleep(TOKEN_DELAY * len(tokens))
            self._json(200, _completion(completion_id, "".join(tokens)))

    def _stream(self, completion_id: str, tokens: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Replica-Id", REPLICA_ID)
        self.end_headers()
        try:
            for i, token in enumerate(tokens):
                delta = {"role": "assistant", "content": token} if i == 0 else {"content": token}
                self._event(_chunk(completion_id, delta, None))
                time.sleep(TOKEN_DELAY)
            self._event(_chunk(completion_id, {}, "stop"))
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")  # the last chunk: end of body
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; stop generating

    def _event(self, payload: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Replica-Id", REPLICA_ID)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no per-request logs


def _tokens(request: dict[str, Any]) -> list[str]:
    messages = request.get("messages") or []
    user = [m.get("content", "") for m in messages if m.get("role") == "user"]
    words = (user[-1] if user and isinstance(user[-1], str) else "").split() or STOCK.split()
    limit = int(request.get("max_tokens") or 16)
    return [w + " " for w in words[: max(limit, 1)]]


def _chunk(completion_id: str, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _completion(completion_id: str, text: str) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
    }


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
    port = int(os.environ.get("PORT", "8000"))
    server = ThreadingHTTPServer((host, port), LLMHandler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, _exit)
    print(f"fake LLM replica {REPLICA_ID or '-'} listening on {host}:{port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
