"""OpenAI-style calls to a real engine (directly or through sluice) for the engine tests:
a chat completion, a streamed one read event by event, and the outcome of each."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.llama import MODEL_ALIAS, Timings, timings


def chat_body(
    messages: list[dict[str, str]] | str, *, max_tokens: int, stream: bool = False
) -> dict[str, Any]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {"model": MODEL_ALIAS, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}  # fmt: skip


async def chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat completion; fails unless it answers 200."""
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, (resp.status, text[:300])
        result: dict[str, Any] = json.loads(text)
        return result


@dataclass
class Stream:
    """What one streamed chat completion delivered."""

    status: int = 0
    content: list[str] = field(default_factory=list)  # the delta of each content event
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`
    last: dict[str, Any] | None = None  # the last JSON event (llama-server's timings)
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def timings(self) -> Timings:
        assert self.last is not None
        return timings(self.last)

    def complete(self, tokens: int) -> bool:
        """200, `tokens` content events, finish_reason "length", then [DONE]."""
        return (
            self.status == 200 and len(self.content) == tokens
            and self.finish_reason == "length" and self.done and self.error is None
        )  # fmt: skip


async def events(resp: aiohttp.ClientResponse, into: Stream) -> None:
    """Read SSE events of `resp` into `into` until [DONE] or the end of the body."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            into.done = True
            return
        event = json.loads(data)
        into.last = event
        for choice in event.get("choices", []):
            if choice.get("delta", {}).get("content"):
                into.content.append(choice["delta"]["content"])
            if choice.get("finish_reason"):
                into.finish_reason = choice["finish_reason"]


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> Stream:
    """A streamed chat completion read to its end; errors are recorded, not raised."""
    out = Stream()
    try:
        body = {**body, "stream": True}
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            out.status = resp.status
            await events(resp, out)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = repr(exc)
    return out
