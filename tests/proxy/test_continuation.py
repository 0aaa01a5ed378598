"""proxy/continuation.py: reading a cut stream, building its continuation, the seam;
and the switch that turns resuming on (the snapshot's field, the proxy's flag)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from proxy.continuation import (
    DONE_EVENT,
    Continue,
    Finish,
    NotResumable,
    Seam,
    event_end,
    plan,
    read_progress,
)
from proxy.readyset import ReadySet
from proxy.resume import resumable_kind
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot, encode_snapshot
from tests.support.builders import snapshot


def chat_event(content: str | None = None, *, role: str | None = None,
               finish: str | None = None, ident: str = "chatcmpl-1", created: int = 100,
               usage: dict[str, int] | None = None) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    obj: dict[str, Any] = {"id": ident, "object": "chat.completion.chunk", "created": created,
                           "model": "m", "choices": [{"index": 0, "delta": delta,
                                                      "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_event(text: str, ident: str = "cmpl-1") -> bytes:
    obj = {"id": ident, "object": "text_completion", "created": 100, "model": "m",
           "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHAT = json.dumps({"model": "m", "stream": True, "max_tokens": 10,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
FIRST = chat_event("", role="assistant") + chat_event("Hello") + chat_event(" wor")


# -- event boundaries ----------------------------------------------------------------


@pytest.mark.parametrize(("data", "end"), [
    (b"data: a\n\n", 9),
    (b"data: a\n\ndata: b", 9),  # the second event has not ended
    (b"data: a\r\n\r\ndata: b\r\n", 11),
    (b"data: a\n", 0),
    (b"", 0),
])
def test_event_end_is_after_the_last_complete_event(data: bytes, end: int) -> None:
    assert event_end(data) == end


# -- what was relayed -----------------------------------------------------------------


def test_progress_reads_text_tokens_and_identity() -> None:
    progress = read_progress("chat", FIRST)
    assert progress.text == "Hello wor"
    assert progress.tokens == 2  # one per content event (no usage in the stream)
    assert progress.ident == {"id": "chatcmpl-1", "created": 100, "model": "m"}
    assert not progress.done and progress.finish_reason is None


def test_reported_usage_counts_over_content_events() -> None:
    relayed = FIRST + chat_event("ld", usage={"prompt_tokens": 3, "completion_tokens": 5})
    assert read_progress("chat", relayed).tokens == 5


@pytest.mark.parametrize(("relayed", "reason"), [
    (b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "x"}]}}]}\n\n',
     "tool_calls"),
    (b'data: {"choices": [{"index": 1, "delta": {"content": "b"}}]}\n\n', "several_choices"),
    (b'data: {"error": {"message": "boom"}}\n\n', "engine_error"),
    (b"data: {not json\n\n", "unparsable_event"),
    (b'data: {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}\n\n',
     "reasoning"),
])
def test_streams_that_cannot_be_continued_say_why(relayed: bytes, reason: str) -> None:
    with pytest.raises(NotResumable) as caught:
        plan("chat", CHAT, relayed, 1)
    assert caught.value.reason == reason


# -- the continuation -----------------------------------------------------------------


def test_chat_continuation_appends_the_partial_answer_and_asks_to_continue_it() -> None:
    step = plan("chat", CHAT, FIRST, 1)
    assert isinstance(step, Continue)
    body = json.loads(step.body)
    assert body["messages"] == [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Hello wor"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8  # 10 less the 2 tokens already streamed
    assert body["stream"] is True


def test_a_client_prefilled_answer_is_extended_not_doubled() -> None:
    request = json.dumps({"stream": True, "continue_final_message": True,
                          "add_generation_prompt": False, "messages": [
                              {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "Sure: "}]}).encode()
    step = plan("chat", request, FIRST, 1)
    assert isinstance(step, Continue)
    messages = json.loads(step.body)["messages"]
    assert messages[-1] == {"role": "assistant", "content": "Sure: Hello wor"}
    assert len(messages) == 2  # llama.cpp refuses two assistant messages at the end


def test_completions_continuation_extends_the_prompt() -> None:
    request = json.dumps({"stream": True, "prompt": "Once", "echo": True,
                          "max_completion_tokens": 5}).encode()
    step = plan("completion", request, text_event(" upon") + text_event(" a"), 1)
    assert isinstance(step, Continue)
    body = json.loads(step.body)
    assert body["prompt"] == "Once upon a"
    assert body["echo"] is False and body["max_completion_tokens"] == 3
    token_prompt = json.dumps({"stream": True, "prompt": [1, 2, 3]}).encode()
    with pytest.raises(NotResumable, match="token_prompt"):
        plan("completion", token_prompt, text_event(" x"), 1)


def test_nothing_streamed_yet_resends_the_request_unchanged() -> None:
    step = plan("chat", CHAT, chat_event("", role="assistant"), 1)
    assert isinstance(step, Continue)
    assert json.loads(step.body) == json.loads(CHAT)


def test_a_finished_answer_only_needs_its_ending() -> None:
    assert plan("chat", CHAT, FIRST + chat_event(finish="stop"), 1) == Finish(DONE_EVENT)
    assert plan("chat", CHAT, FIRST + DONE_EVENT, 1) == Finish(b"")  # nothing missing


def test_max_tokens_used_up_ends_with_a_length_finish() -> None:
    request = json.dumps({"stream": True, "max_tokens": 2, "messages": []}).encode()
    step = plan("chat", request, FIRST, 1)
    assert isinstance(step, Finish)
    final, done = step.tail.split(b"\n\n")[:2]
    obj = json.loads(final[6:])
    assert obj["id"] == "chatcmpl-1" and obj["choices"][0]["finish_reason"] == "length"
    assert done == b"data: [DONE]"


@pytest.mark.parametrize("request_body", [
    b"not json", json.dumps({"stream": False, "messages": []}).encode(),
    json.dumps({"stream": True, "n": 2, "messages": []}).encode(),
])
def test_requests_that_cannot_be_continued(request_body: bytes) -> None:
    with pytest.raises(NotResumable):
        plan("chat", request_body, FIRST, 1)


# -- the seam ---------------------------------------------------------------------------


def test_the_seam_makes_the_continuation_read_as_the_first_part() -> None:
    step = plan("chat", CHAT, FIRST, 1)
    assert isinstance(step, Continue)
    seam: Seam = step.seam
    continuation = (chat_event("", role="assistant", ident="other", created=999)
                    + chat_event("ld", ident="other", created=999)
                    + chat_event(finish="length", ident="other", created=999)
                    + chat_event(None, ident="other", usage={
                        "prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15})
                    + DONE_EVENT)
    out = seam.rewrite(continuation)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    objs = [msgspec.json.decode(e[6:]) for e in events[:-1]]
    assert [o["choices"][0]["delta"] for o in objs[:2]] == [{"content": "ld"}, {}]
    assert {(o["id"], o["created"]) for o in objs} == {("chatcmpl-1", 100)}
    usage = objs[-1]["usage"]
    # The continuation's prompt held the 2 tokens of the first part: they move back.
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        5, 10, 15)
    assert usage["sluice_resumed"]["estimated"] is True
    comment = b": keep-alive\n\n"
    assert seam.rewrite(comment) == comment  # what it cannot read passes unchanged


# -- the switch -------------------------------------------------------------------------


def test_resumable_requests_are_streaming_posts_to_the_completions_endpoints() -> None:
    assert resumable_kind(b"POST", b"/v1/chat/completions") == "chat"
    assert resumable_kind(b"POST", b"/v1/completions?x=1") == "completion"
    assert resumable_kind(b"GET", b"/v1/chat/completions") is None
    assert resumable_kind(b"POST", b"/v1/embeddings") is None


def test_the_snapshot_turns_resuming_on_unless_the_flag_decides() -> None:
    on = msgspec.structs.replace(snapshot(1, "http://127.0.0.1:1"), resume_streams=True)
    follows = ReadySet()
    assert follows.resume_streams is False
    follows.apply(on)
    assert follows.resume_streams is True
    forced_off = ReadySet(resume_streams=False)
    forced_off.apply(on)
    assert forced_off.resume_streams is False
    forced_on = ReadySet(resume_streams=True)
    forced_on.apply(snapshot(1, "http://127.0.0.1:1"))
    assert forced_on.resume_streams is True


def test_old_snapshots_read_as_resume_off_and_the_field_round_trips() -> None:
    old = b'{"service": "s", "generation": 1, "published_at": 0.0, "replicas": []}'
    assert decode_snapshot(old).resume_streams is False
    new = ReadySnapshot(service="s", generation=1, published_at=0.0, resume_streams=True)
    assert decode_snapshot(encode_snapshot(new)).resume_streams is True

