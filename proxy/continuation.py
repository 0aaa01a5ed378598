"""What a cut OpenAI-compatible stream said so far, and the request that continues it.

Pure functions over bytes, used by proxy/resume.py only when a stream needs resuming
(and, once resumed, on the continuation's events): nothing here runs on the common
request path.

- `event_end(data)`: where the last complete SSE event of `data` ends (a relayed
  stream is cut only at event boundaries, so the client never holds half an event).
- `plan(kind, original, relayed)`: reads the events relayed so far (text, token
  count, id/created/model, finish) and returns either `Finish` (the answer was
  already complete: only its ending is missing) or `Continue` (the body to send to
  another replica and the `Seam` that rewrites its events). Raises NotResumable
  naming why not.
- `Seam.rewrite(events)`: the continuation's events made to read as the rest of the
  first part: the first part's id, created and model; no second role chunk; usage
  shifted so that tokens of the first part count as completion tokens.

The continuation, per endpoint (engines: docs/resume.md):
- chat: the original messages plus an assistant message holding the text so far
  (appended to a final assistant message the client itself asked to continue), with
  `continue_final_message: true, add_generation_prompt: false` (vLLM, SGLang; a
  final assistant message is continued by llama.cpp's server by default);
- completions: the prompt followed by the text so far (`echo` off);
- `max_tokens` / `max_completion_tokens` less the tokens already streamed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Kind = Literal["chat", "completion"]

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n")
_LINE = re.compile(rb"\r\n|\n|\r")
DONE_EVENT = b"data: [DONE]\n\n"
_ENCODER = msgspec.json.Encoder()


class NotResumable(Exception):
    """This stream cannot be continued; `reason` is a short metric-friendly name."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in `data` (0: none is complete)."""
    if data.endswith(b"\n\n"):
        return len(data)
    end = 0
    for match in _EVENT_END.finditer(data):
        end = match.end()
    return end


def _events(data: bytes) -> list[bytes]:
    """The complete events of `data`, each without its blank line."""
    parts = _EVENT_END.split(data)
    return parts[:-1] if parts and not parts[-1] else parts


def _data_of(event: bytes) -> bytes | None:
    """The joined `data:` field of one event (None: the event has none)."""
    values = []
    for line in _LINE.split(event):
        if line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values) if values else None


@dataclass
class Progress:
    """What the events relayed so far say."""

    text: str = ""
    tokens: int = 0  # content events seen, or the last completion_tokens reported
    content_events: int = 0
    usage_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False  # data: [DONE] seen
    ident: dict[str, Any] = field(default_factory=dict)  # id, created, model (first seen)


def read_progress(kind: Kind, relayed: bytes) -> Progress:
    progress = Progress()
    parts: list[str] = []
    for event in _events(relayed):
        data = _data_of(event)
        if data is None:
            continue
        if data.strip() == b"[DONE]":
            progress.done = True
            continue
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise NotResumable("unparsable_event") from None
        if not isinstance(obj, dict):
            raise NotResumable("unparsable_event")
        if "error" in obj:
            raise NotResumable("engine_error")
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in obj and key not in progress.ident:
                progress.ident[key] = obj[key]
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            progress.usage_tokens = usage["completion_tokens"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                raise NotResumable("unparsable_event")
            if choice.get("index", 0) != 0:
                raise NotResumable("several_choices")
            piece = _piece(kind, choice)
            if piece:
                parts.append(piece)
                progress.content_events += 1
            if choice.get("finish_reason") is not None:
                progress.finish_reason = choice["finish_reason"]
    progress.text = "".join(parts)
    progress.tokens = (progress.usage_tokens if progress.usage_tokens is not None
                       else progress.content_events)
    return progress


def _piece(kind: Kind, choice: dict[str, Any]) -> str:
    if kind == "completion":
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    if delta.get("tool_calls") or delta.get("function_call"):
        raise NotResumable("tool_calls")
    if delta.get("reasoning_content") or delta.get("reasoning"):
        raise NotResumable("reasoning")
    content = delta.get("content")
    return content if isinstance(content, str) else ""


@dataclass(frozen=True)
class Finish:
    """Nothing to generate: send `tail` and end the stream."""

    tail: bytes


@dataclass(frozen=True)
class Continue:
    body: bytes
    seam: Seam


def plan(kind: Kind, original: bytes, relayed: bytes, resumes: int) -> Finish | Continue:
    """How to go on after the stream `relayed` so far, for the request body `original`."""
    progress = read_progress(kind, relayed)
    if progress.done:
        return Finish(b"")
    if progress.finish_reason is not None:
        return Finish(DONE_EVENT)
    try:
        request = msgspec.json.decode(original)
    except msgspec.DecodeError:
        raise NotResumable("unparsable_request") from None
    if not isinstance(request, dict) or request.get("stream") is not True:
        raise NotResumable("unparsable_request")
    for key in ("n", "best_of"):
        if request.get(key) not in (None, 1):
            raise NotResumable("several_choices")
    for key in ("max_tokens", "max_completion_tokens"):
        limit = request.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            left = limit - progress.tokens
            if left <= 0:
                return Finish(_final_chunk(kind, progress.ident, "length") + DONE_EVENT)
            request[key] = left
    if progress.text:
        if kind == "chat":
            _continue_chat(request, progress.text)
        else:
            _continue_prompt(request, progress.text)
    return Continue(_ENCODER.encode(request), Seam(kind, progress, resumes))


def _continue_chat(request: dict[str, Any], text: str) -> None:
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotResumable("unparsable_request")
    last = messages[-1]
    if (request.get("continue_final_message") is True and isinstance(last, dict)
            and last.get("role") == "assistant" and isinstance(last.get("content"), str)):
        # The client prefilled the answer itself: the text so far continues that message.
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    request["continue_final_message"] = True
    request["add_generation_prompt"] = False


def _continue_prompt(request: dict[str, Any], text: str) -> None:
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        request["prompt"] = prompt + text
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        request["prompt"] = [prompt[0] + text]
    else:
        raise NotResumable("token_prompt")  # token ids: the text cannot be appended
    if request.get("echo"):
        request["echo"] = False  # the prompt was echoed in the first part already


def _final_chunk(kind: Kind, ident: dict[str, Any], reason: str) -> bytes:
    if kind == "chat":
        obj: dict[str, Any] = {"object": "chat.completion.chunk",
                               "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    else:
        obj = {"object": "text_completion",
               "choices": [{"index": 0, "text": "", "finish_reason": reason}]}
    obj.update({k: v for k, v in ident.items() if k in ("id", "created", "model")})
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


class Seam:
    """Rewrites a continuation's events to read as the rest of the first part."""

    def __init__(self, kind: Kind, progress: Progress, resumes: int) -> None:
        self.kind = kind
        self.ident = {k: v for k, v in progress.ident.items() if k in ("id", "created", "model")}
        self.before = progress.tokens  # completion tokens of the parts before this one
        self.resumes = resumes

    def rewrite(self, data: bytes) -> bytes:
        """`data` holds complete events only; returns them rewritten (some dropped)."""
        out = []
        for event in _events(data):
            rewritten = self._event(event)
            if rewritten:
                out.append(rewritten)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        data = _data_of(event)
        if data is None or data.strip() == b"[DONE]":
            return event + b"\n\n"
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return event + b"\n\n"  # not ours to judge: relayed as it came
        if not isinstance(obj, dict) or "error" in obj:
            return event + b"\n\n"
        for key, value in self.ident.items():
            if key in obj:
                obj[key] = value
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(choices, list) and choices:
            if self.kind == "chat":
                for choice in choices:
                    delta = choice.get("delta") if isinstance(choice, dict) else None
                    if isinstance(delta, dict):
                        delta.pop("role", None)  # the first part opened the message
            if usage is None and all(_empty(self.kind, c) for c in choices):
                return b""  # an opening chunk with nothing in it
        if isinstance(usage, dict):
            self._shift(usage)
        other = [line for line in _LINE.split(event) if line and not line.startswith(b"data:")]
        return b"".join(line + b"\n" for line in other) + b"data: " + _ENCODER.encode(obj) + b"\n\n"

    def _shift(self, usage: dict[str, Any]) -> None:
        """The continuation counted the first part's tokens as prompt: move them back.

        The first part's count is an estimate (one token per content event unless the
        stream reported usage), so the usage says so.
        """
        before = self.before
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            usage["completion_tokens"] = completion + before
        if isinstance(prompt, int):
            usage["prompt_tokens"] = max(0, prompt - before)
        if isinstance(usage.get("total_tokens"), int) and isinstance(prompt, int):
            usage["total_tokens"] = usage["prompt_tokens"] + usage.get("completion_tokens", 0)
        usage["sluice_resumed"] = {"resumes": self.resumes, "first_part_tokens": before,
                                   "estimated": True}


def _empty(kind: Kind, choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("logprobs"):
        return False
    if kind == "completion":
        return not choice.get("text")
    delta = choice.get("delta")
    return not isinstance(delta, dict) or not any(v not in (None, "") for v in delta.values())
