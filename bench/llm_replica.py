"""A simulated vLLM-like OpenAI-compatible replica, for bench/routing.py.

Time is modelled, not spent: a step of the engine sleeps for
``base + prefill tokens x prefill_cost + decoding sequences x decode_cost``,
so the results barely depend on the CPU the benchmark runs on.

- Tokenizer: deterministic, one token per 4 bytes of the rendered prompt
  (the chat template below); so the token sequence of a prompt is a prefix of
  the next turn's when the text is.
- Prefix cache: blocks of 16 tokens keyed by the hash chain of the prefix
  (block i's key covers blocks 0..i, as vLLM's), LRU eviction, a capacity in
  tokens. A request's cached tokens are its leading blocks found in the cache
  when the engine first schedules its prefill, not when it arrives; the blocks a
  step prefills are cached as the step is scheduled, and at the end of a request
  its output blocks too. So a second request for a prompt the engine is still
  prefilling hits, as in vLLM v1 (its KV cache manager caches the full blocks it
  allocates for a step, and a waiting request is matched when scheduled).
- Continuous batching: at most ``max_batch`` running sequences, the rest wait
  in a FIFO queue; each step prefills up to ``prefill_budget`` uncached
  tokens (chunked prefill) and decodes one token for every running sequence
  already past its prefill. The first token is emitted at the end of the step
  that finishes a sequence's prefill.
- HTTP: ``POST /v1/chat/completions`` and ``/v1/completions`` (stream or
  not; streamed usage carries ``prompt_tokens_details.cached_tokens``),
  ``GET /metrics`` (vLLM-style names), ``/health``, ``/v1/models`` and the
  model list; ``POST /reset`` empties the cache
  and counters (the benchmark calls it between targets). Every response
  carries ``X-Replica-Id``.

One process serves a whole fleet (one listener per replica):

    python bench/llm_replica.py --ports 8001,8002,8003,8004 --cache-tokens 16384
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import signal
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from aiohttp import web

BLOCK_TOKENS = 16
WORDS = ("the of and to in is that for it as with was on be by at this are from or an "
         "which one have not but all they were can there been has more if will would "
         "model cache token prefix replica router request answer batch step").split()


def render(messages: list[dict[str, str]]) -> str:
    """The chat template: every message, then the assistant's turn marker."""
    parts = [f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def tokenize(text: str) -> list[bytes]:
    data = text.encode()
    return [data[i:i + 4] for i in range(0, len(data), 4)]


def block_keys(tokens: list[bytes]) -> list[bytes]:
    """Chain hashes of the complete 16-token blocks."""
    keys = []
    h = b""
    for i in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hashlib.blake2b(h + b"".join(tokens[i:i + BLOCK_TOKENS]), digest_size=12).digest()
        keys.append(h)
    return keys


def output_text(seed: bytes, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class EngineConfig:
    cache_tokens: int = 16384
    max_batch: int = 32
    prefill_budget: int = 2048  # uncached tokens prefilled per step
    step_base: float = 0.010
    prefill_cost: float = 0.00025  # seconds per uncached prompt token
    decode_cost: float = 0.0004  # seconds per decoding sequence per step
    stream_every: int = 4  # decode steps per streamed chunk after the first token


@dataclass(eq=False)
class Seq:
    text: str
    prompt: list[bytes]
    max_tokens: int
    out_words: list[str]
    cached: int = -1  # -1: not scheduled yet (matched against the cache then)
    prefilled: int = 0
    generated: int = 0
    keys: list[bytes] = field(default_factory=list)
    queue: asyncio.Queue[tuple[int, bool]] = field(default_factory=asyncio.Queue)


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: list[bytes]) -> int:
        """Leading blocks present (each touched as used)."""
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            self.blocks.move_to_end(k)
            n += 1
        return n

    def insert(self, keys: list[bytes]) -> None:
        for k in keys:
            self.blocks[k] = None
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Engine:
    def __init__(self, replica_id: str, cfg: EngineConfig) -> None:
        self.id = replica_id
        self.cfg = cfg
        self.cache = PrefixCache(cfg.cache_tokens // BLOCK_TOKENS)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.reset()

    def reset(self) -> None:
        self.cache.blocks.clear()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them found cached
        self.requests = 0
        self.busy = 0.0  # modelled seconds spent in steps

    def submit(self, seq: Seq) -> None:
        seq.keys = block_keys(seq.prompt)
        self.requests += 1
        self.waiting.append(seq)
        self.wake.set()

    def schedule(self, seq: Seq) -> None:
        """`seq` gets its first prefill budget: its cached tokens are its leading blocks in
        the cache now, including those of a prefill scheduled before it in this step."""
        # The last prompt token is always computed (as in vLLM): at most all but one block.
        matched = min(self.cache.match(seq.keys), max(0, (len(seq.prompt) - 1) // BLOCK_TOKENS))
        seq.cached = matched * BLOCK_TOKENS
        seq.prefilled = seq.cached
        self.queries += len(seq.prompt)
        self.hits += seq.cached

    async def run(self) -> None:
        cfg = self.cfg
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            while self.waiting and len(self.running) < cfg.max_batch:
                self.running.append(self.waiting.popleft())
            budget = cfg.prefill_budget
            prefill = 0
            decoding = 0
            finishing_prefill = []
            for seq in self.running:
                if seq.cached < 0:
                    if budget <= 0:
                        continue
                    self.schedule(seq)
                left = len(seq.prompt) - seq.prefilled
                if left > 0:
                    if budget <= 0:
                        continue
                    take = min(left, budget)
                    budget -= take
                    prefill += take
                    seq.prefilled += take
                    # Cached as scheduled (vLLM v1): a request scheduled after this one,
                    # in this step or a later one, finds these blocks.
                    self.cache.insert(seq.keys[:seq.prefilled // BLOCK_TOKENS])
                    if seq.prefilled >= len(seq.prompt):
                        finishing_prefill.append(seq)
                else:
                    decoding += 1
            step = cfg.step_base + prefill * cfg.prefill_cost + decoding * cfg.decode_cost
            self.busy += step
            await asyncio.sleep(step)
            done = []
            for seq in self.running:
                if seq in finishing_prefill:
                    seq.generated = 1
                    seq.queue.put_nowait((1, seq.generated >= seq.max_tokens))
                elif seq.prefilled >= len(seq.prompt):
                    seq.generated += 1
                    last = seq.generated >= seq.max_tokens
                    if last or seq.generated % cfg.stream_every == 0:
                        seq.queue.put_nowait((seq.generated, last))
                if seq.generated >= seq.max_tokens:
                    done.append(seq)
            for seq in done:
                self.running.remove(seq)
                full = seq.text + " ".join(seq.out_words)
                self.cache.insert(block_keys(tokenize(full)))


class Replica:
    def __init__(self, replica_id: str, cfg: EngineConfig) -> None:
        self.engine = Engine(replica_id, cfg)
        self.headers = {"X-Replica-Id": replica_id}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.complete)
        r.add_post("/v1/completions", self.complete)
        r.add_post("/generate", self.complete)
        r.add_get("/metrics", self.metrics)
        r.add_get("/stats", self.stats)
        r.add_post("/reset", self.reset)
        for path in ("/health", "/health_generate", "/readiness", "/liveness"):
            r.add_get(path, self.health)
        # Only /v1/models: given a model path on its info endpoints, sglang-router would
        # try to download that model's tokenizer from the internet.
        r.add_get("/v1/models", self.info)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok", headers=self.headers)

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "sim", "object": "model"}]},
            headers=self.headers)

    async def reset(self, request: web.Request) -> web.Response:
        self.engine.reset()
        return web.Response(text="reset", headers=self.headers)

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({"id": e.id, "requests": e.requests, "queries": e.queries,
                                  "hits": e.hits, "busy": e.busy,
                                  "cached_blocks": len(e.cache.blocks)}, headers=self.headers)

    async def metrics(self, request: web.Request) -> web.Response:
        e = self.engine
        text = (
            f"vllm:num_requests_running {len(e.running)}\n"
            f"vllm:num_requests_waiting {len(e.waiting)}\n"
            f"vllm:prefix_cache_queries_total {e.queries}\n"
            f"vllm:prefix_cache_hits_total {e.hits}\n"
            f"vllm:request_success_total {e.requests}\n"
            f"vllm:gpu_cache_usage_perc {len(e.cache.blocks) / e.cache.capacity:.4f}\n"
        )
        return web.Response(text=text, headers=self.headers)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if "messages" in body:
                prompt = render(body["messages"])
            else:
                prompt = str(body.get("prompt", body.get("text", "")))
            # sglang-router rewrites max_tokens as max_completion_tokens.
            max_tokens = max(1, int(body.get("max_tokens")
                                    or body.get("max_completion_tokens") or 16))
        except (ValueError, TypeError, AttributeError):
            return web.json_response({"error": "bad request"}, status=400, headers=self.headers)
        tokens = tokenize(prompt)
        digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
        words = output_text(digest, max_tokens).split()
        seq = Seq(text=prompt, prompt=tokens, max_tokens=max_tokens, out_words=words)
        self.engine.submit(seq)
        usage = {"prompt_tokens": len(tokens), "completion_tokens": max_tokens,
                 "total_tokens": len(tokens) + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # known once scheduled
        chat = "messages" in body
        if not body.get("stream"):
            while True:
                _, last = await seq.queue.get()
                if last:
                    break
            usage["prompt_tokens_details"] = {"cached_tokens": seq.cached}
            text = " ".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat
                      else {"index": 0, "text": text, "finish_reason": "length"})
            return web.json_response({"id": "sim", "object": "completion", "model": "sim",
                                      "choices": [choice], "usage": usage},
                                     headers=self.headers)
        resp = web.StreamResponse(headers={**self.headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = 0
        while True:
            upto, last = await seq.queue.get()
            piece = " ".join(words[sent:upto]) + (" " if not last else "")
            sent = upto
            delta = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                     else {"index": 0, "text": piece, "finish_reason": None})
            chunk = {"id": "sim", "object": "chat.completion.chunk", "model": "sim",
                     "choices": [delta]}
            if last:
                usage["prompt_tokens_details"] = {"cached_tokens": seq.cached}
                chunk["usage"] = usage
                delta["finish_reason"] = "length"
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if last:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def serve(ports: list[int], host: str, cfg: EngineConfig, ready_file: str | None) -> None:
    runners = []
    replicas = []
    for i, port in enumerate(ports):
        rep = Replica(f"r{i}", cfg)
        rep.engine.task = asyncio.get_running_loop().create_task(rep.engine.run())
        runner = web.AppRunner(rep.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=1024).start()
        runners.append(runner)
        replicas.append(rep)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(str(time.time()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for rep in replicas:
            if rep.engine.task is not None:
                rep.engine.task.cancel()
        for runner in runners:
            await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ports", required=True, help="comma-separated ports, one replica each")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--cache-tokens", type=int, default=EngineConfig.cache_tokens)
    ap.add_argument("--max-batch", type=int, default=EngineConfig.max_batch)
    ap.add_argument("--prefill-budget", type=int, default=EngineConfig.prefill_budget)
    ap.add_argument("--step-base", type=float, default=EngineConfig.step_base)
    ap.add_argument("--prefill-cost", type=float, default=EngineConfig.prefill_cost)
    ap.add_argument("--decode-cost", type=float, default=EngineConfig.decode_cost)
    ap.add_argument("--stream-every", type=int, default=EngineConfig.stream_every)
    ap.add_argument("--ready-file", help="written once every listener is up")
    args = ap.parse_args()
    cfg = EngineConfig(cache_tokens=args.cache_tokens, max_batch=args.max_batch,
                       prefill_budget=args.prefill_budget, step_base=args.step_base,
                       prefill_cost=args.prefill_cost, decode_cost=args.decode_cost,
                       stream_every=args.stream_every)
    ports = [int(p) for p in args.ports.split(",") if p]
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(ports, args.host, cfg, args.ready_file))


if __name__ == "__main__":
    main()
