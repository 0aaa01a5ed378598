"""A fake of vLLM's OpenAI-compatible API: the fields a stream continuation uses.

Run as ``python -m tests.support.vllm_fake --port P [--id ID] [--token-delay S]``.
No model: the "tokens" of an answer are a fixed function of the request (the
words of `WORDS`, starting at a place chosen by the prompt's hash), so a test
knows the whole answer an uninterrupted replica gives and can check a resumed
stream against it, word for word.

What it honours, as vLLM does (vllm/entrypoints/openai/protocol.py,
ChatCompletionRequest):
- `POST /v1/chat/completions`: with `continue_final_message: true` and a final
  assistant message, the answer continues that message: generation resumes after
  its words and only the new words are streamed. Without it, a final assistant
  message is history and a new answer starts (word 0). Both flags true is a 400,
  as in vLLM's `check_generation_prompt`.
- `POST /v1/completions`: the prompt's words after the original prompt (a prompt
  that ends with words of its own answer) continue that answer.
- `stream: true` (SSE: a role chunk, one chunk per word, a finish chunk, a usage
  chunk if `stream_options.include_usage`, `data: [DONE]`), `max_tokens`.

The original prompt of a continuation is found by stripping the answer's words
from the end (`_split`), which works because the answer's words are `WORDS`.
`/stats` says how many requests were continuations; `/health` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

from tests.support.replica_app import serve_app

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon phi chi psi omega").split()
STATS = web.AppKey("stats", dict)
DELAY = web.AppKey("delay", float)


def answer_words(seed_text: str, start: int, count: int) -> list[str]:
    """Words `start` .. `start + count` of the answer to `seed_text`."""
    base = int(hashlib.sha256(seed_text.encode()).hexdigest(), 16) % len(WORDS)
    return [WORDS[(base + i) % len(WORDS)] + " " for i in range(start, start + count)]


def full_answer(seed_text: str, count: int) -> str:
    """The whole text an uninterrupted stream of `count` tokens carries."""
    return "".join(answer_words(seed_text, 0, count))


def _prompt_of(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages if m.get("role") != "assistant")


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    messages = body.get("messages") or []
    continuing = bool(body.get("continue_final_message"))
    if continuing and body.get("add_generation_prompt", True):
        return web.json_response({"error": {"message": "Cannot set both "
                                  "`continue_final_message` and `add_generation_prompt` to "
                                  "True."}}, status=400)
    start, prefix = 0, ""
    if continuing and messages and messages[-1].get("role") == "assistant":
        prefix = messages[-1].get("content") or ""
        start = len(prefix.split())
        request.app[STATS]["continuations"] += 1
        request.app[STATS]["last_prefix"] = prefix
    seed = _prompt_of(messages)
    return await _stream(request, body, "chat", seed, start,
                         prompt_tokens=len(seed.split()) + start)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt = body.get("prompt")
    prompt = prompt[0] if isinstance(prompt, list) else str(prompt or "")
    seed, start = _split(prompt)
    if start:
        request.app[STATS]["continuations"] += 1
        request.app[STATS]["last_prefix"] = prompt[len(seed):]
    return await _stream(request, body, "completion", seed, start,
                         prompt_tokens=len(prompt.split()))


def _split(prompt: str) -> tuple[str, int]:
    """(original prompt, words of its answer at its end) of a completions prompt."""
    for cut in range(len(prompt) + 1):
        seed, tail = prompt[:cut], prompt[cut:]
        words = tail.split()
        if tail.startswith(" ") or not words:
            continue
        if "".join(answer_words(seed, 0, len(words))) == tail:
            return seed, len(words)
    return prompt, 0


async def _stream(request: web.Request, body: dict[str, Any], kind: str, seed: str, start: int,
                  *, prompt_tokens: int) -> web.StreamResponse:
    count = int(body.get("max_tokens") or 16)
    words = answer_words(seed, start, count)
    ident = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:12]}",
             "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
             "created": int(time.time()), "model": body.get("model") or "fake-vllm"}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    delay = request.app[DELAY]

    async def send(choice: dict[str, Any], usage: dict[str, int] | None = None) -> None:
        event = {**ident, "choices": [choice] if choice else []}
        if usage is not None:
            event["usage"] = usage
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")

    if kind == "chat":
        await send({"index": 0, "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None})
    for word in words:
        await asyncio.sleep(delay)
        if kind == "chat":
            await send({"index": 0, "delta": {"content": word}, "finish_reason": None})
        else:
            await send({"index": 0, "text": word, "finish_reason": None})
    finish: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    finish.update({"delta": {}} if kind == "chat" else {"text": ""})
    await send(finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        await send({}, {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                        "total_tokens": prompt_tokens + len(words)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@web.middleware
async def count(request: web.Request, handler):  # type: ignore[no-untyped-def]
    stats = request.app[STATS]
    if request.path in ("/stats", "/health"):
        return await handler(request)
    stats["requests"] += 1
    stats["in_flight"] += 1
    try:
        return await handler(request)
    finally:
        stats["in_flight"] -= 1


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS])


def make_app(replica_id: str, delay: float) -> web.Application:
    app = web.Application(middlewares=[count])
    app[STATS] = {"id": replica_id, "requests": 0, "in_flight": 0, "continuations": 0,
                  "last_prefix": None}
    app[DELAY] = delay
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


async def serve(port: int, replica_id: str, delay: float, host: str) -> None:
    await serve_app(make_app(replica_id, delay), host, port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--id", default=None, help="replica id (default: the port)")
    p.add_argument("--token-delay", type=float, default=0.05, help="seconds between tokens")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.id or str(args.port), args.token_delay, args.host))


if __name__ == "__main__":
    main()
