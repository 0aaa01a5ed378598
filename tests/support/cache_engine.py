"""A scripted engine (named as one): the *wire format* in which llama.cpp and vLLM report
the prompt tokens they took from their prefix cache, with a real cache of prompts behind.

Run as ``python -m tests.support.cache_engine --port P --format llama|vllm [--id ID]``.
``POST /v1/chat/completions`` (and ``/v1/completions``) remembers each prompt (the
``messages`` re-serialised, or ``prompt``; the last 256); a request's cached tokens are
its longest common prefix with a prompt seen before, in bytes, over 4 (about a token
each). Reported as the engines do:

- ``llama``: ``"timings": {"cache_n": N, "prompt_n": M, ...}`` in the body, and in
  the last event of a stream (llama.cpp's server, tools/server/server.cpp);
- ``vllm``: ``usage.prompt_tokens_details.cached_tokens`` in the body, and in a
  stream only in the usage event sent when the client asked for
  ``stream_options.include_usage`` (vllm/entrypoints/openai/serving_chat.py).

``"pieces": N, "pace": S`` make a stream N events longer, S seconds apart (at most 600
and 5 s): a stream of tens of seconds. ``"delay": S`` in a request holds its answer S
seconds (at most 60), so a test can keep
requests in flight. ``GET /requests`` lists what the last 256 requests asked and got:
``max_tokens``, ``stream``, their ``X-Sluice-Warmup``, ``Authorization`` and
``X-Real-IP`` headers and the ``tokens`` and ``cached`` tokens reported. ``POST /flush``
forgets every prompt (an engine restarted, or its cache evicted);
``"hostile": true`` in a request makes the answer carry 1,000 decoy markers and a
million-digit ``"cache_n"`` before its real report (the proxy's scanner must neither
choke nor count them). Every response carries ``X-Replica-Id``; ``/health`` is 200.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from tests.support.replica_app import serve_app

SEEN = web.AppKey("seen", list)
LOG = web.AppKey("log", list)
FORMAT = web.AppKey("format", str)
ID = web.AppKey("id", str)
MAX_SEEN = 256


def _common(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _report(fmt: str, prompt: int, cached: int) -> dict[str, Any]:
    if fmt == "llama":
        return {"timings": {"cache_n": cached, "prompt_n": prompt - cached,
                            "prompt_ms": 1.0, "predicted_n": 2}}  # fmt: skip
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                      "total_tokens": prompt + 2,
                      "prompt_tokens_details": {"cached_tokens": cached}}}  # fmt: skip


_DECOYS = (b'{"note":"' + b'\\"cache_n\\":7 ' * 500 + b'","cache_prompt":true,'
           b'"cache_n":' + b"9" * 1_000_000 + b',"x":[' + b'"cache_n",' * 500 + b'0]}')


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await request.json()
    prompt = json.dumps(body.get("messages") or body.get("prompt")).encode()
    seen: list[bytes] = app[SEEN]
    common = max((_common(prompt, p) for p in seen), default=0)
    seen.append(prompt)
    del seen[:-MAX_SEEN]
    tokens, cached = len(prompt) // 4, common // 4
    log: list[dict[str, Any]] = app[LOG]
    log.append({"max_tokens": body.get("max_tokens"), "stream": body.get("stream"),
                "warmup": request.headers.get("X-Sluice-Warmup"),
                "authorization": request.headers.get("Authorization"),
                "x_real_ip": request.headers.get("X-Real-IP"),
                "tokens": tokens, "cached": cached})  # fmt: skip
    del log[:-MAX_SEEN]
    delay = body.get("delay")
    if isinstance(delay, (int, float)) and delay > 0:
        await asyncio.sleep(min(float(delay), 60.0))
    fmt = app[FORMAT]
    headers = {"X-Replica-Id": app[ID]}
    text = [f"answer from {app[ID]}", "."]
    pieces = body.get("pieces")  # a long stream: this many more events, `pace` s apart
    if isinstance(pieces, int) and 0 < pieces <= 600:
        text[1:1] = [f" {i}" for i in range(pieces)]
    pace = body.get("pace")
    pace = min(float(pace), 5.0) if isinstance(pace, (int, float)) and pace > 0 else 0.0
    if not body.get("stream"):
        out: dict[str, Any] = {"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
             "finish_reason": "stop"}]}  # fmt: skip
        out.update(_report(fmt, tokens, cached))
        raw = json.dumps(out, separators=(",", ":")).encode()
        if body.get("hostile"):
            raw = _DECOYS + b"\n" + raw
        return web.Response(body=raw, content_type="application/json", headers=headers)
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, piece in enumerate(text):
        event: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": piece},
             "finish_reason": "stop" if i == len(text) - 1 else None}]}  # fmt: skip
        if fmt == "llama" and i == len(text) - 1:
            event.update(_report(fmt, tokens, cached))  # llama.cpp: in the last event
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if pace and i < len(text) - 1:
            await asyncio.sleep(pace)
    if fmt == "vllm" and (body.get("stream_options") or {}).get("include_usage"):
        usage = {"id": "x", "object": "chat.completion.chunk", "choices": [],
                 **_report(fmt, tokens, cached)}  # fmt: skip
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def flush(request: web.Request) -> web.Response:
    request.app[SEEN].clear()
    return web.Response(text="flushed")


async def requests(request: web.Request) -> web.Response:
    return web.json_response(request.app[LOG])


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(fmt: str, replica_id: str) -> web.Application:
    app = web.Application()
    app[SEEN] = []
    app[LOG] = []
    app[FORMAT] = fmt
    app[ID] = replica_id
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/flush", flush)
    app.router.add_get("/health", health)
    app.router.add_get("/requests", requests)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--format", choices=("llama", "vllm"), required=True)
    p.add_argument("--id", default=None, help="replica id (default: the port)")
    args = p.parse_args()
    app = make_app(args.format, args.id or str(args.port))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_app(app, args.host, args.port))


if __name__ == "__main__":
    main()
