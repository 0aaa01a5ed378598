"""A fake of an engine's *metrics format* (named as a fake): a replica that serves vLLM's,
SGLang's or TGI's Prometheus page, with a real queue behind it, for the engines that
cannot run on this machine (llama.cpp runs for real: tests/support/llama.py).

Run as ``python -m tests.support.engine_fake --port P --engine vllm|sglang|tgi
[--slots N] [--hold S]``. Every request other than ``/health`` and ``/metrics`` takes
one of ``slots`` places for ``hold`` seconds (``?hold=S`` overrides it) and waits in a
queue when none is free; the page reports that state under the engine's own names:

- vLLM: vllm/v1/metrics/loggers.py (`PrometheusStatLogger`): `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0-1),
  `vllm:prefix_cache_queries`/`_hits` (counters, tokens), `vllm:generation_tokens`,
  `vllm:time_to_first_token_seconds` (its buckets), `vllm:cache_config_info` (an info
  gauge whose labels carry `block_size` and `num_gpu_blocks`); labels `model_name`,
  `engine`.
- SGLang: python/sglang/srt/metrics/collector.py and docs/references/
  production_metrics.md: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
  `sglang:token_usage` (0-1), `sglang:cache_hit_rate`, `sglang:max_total_num_tokens`,
  `sglang:gen_throughput`, `sglang:generation_tokens`,
  `sglang:time_to_first_token_seconds`; label `model_name`.
- TGI: docs/source/reference/metrics.md: `tgi_batch_current_size`, `tgi_queue_size`,
  `tgi_batch_current_max_tokens`, `tgi_request_generated_tokens` (histogram),
  `tgi_request_count`; no labels (TGI's Rust exporter writes the same text format).

vLLM and SGLang render their pages with prometheus_client, as this fake does; the
values are this fake's (a prefix "hit" is a request whose `?prefix=` it saw before).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MODEL = "fake/model"
KV_TOKENS = 32768
TOKENS_PER_REQUEST = 16
_VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
              5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_SGLANG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]


class Engine:
    """The fake's state: slots, a queue, and the page in one engine's names."""

    def __init__(self, engine: str, slots: int, hold: float) -> None:
        self.engine, self.slots, self.hold = engine, slots, hold
        self.gate = asyncio.Semaphore(slots)
        self.running = 0
        self.waiting = 0
        self.seen: set[str] = set()
        self.registry = CollectorRegistry()
        r = self.registry
        if engine == "vllm":
            labels = ["model_name", "engine"]
            self.values = (MODEL, "0")
            self.g_running = Gauge("vllm:num_requests_running",
                                   "Number of requests in model execution batches.", labels,
                                   registry=r)  # fmt: skip
            self.g_waiting = Gauge("vllm:num_requests_waiting",
                                   "Number of requests waiting to be processed.", labels,
                                   registry=r)  # fmt: skip
            self.g_kv = Gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
            self.c_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in "
                                     "terms of number of queried tokens.", labels, registry=r)
            self.c_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of "
                                  "number of cached tokens.", labels, registry=r)
            self.c_gen = Counter("vllm:generation_tokens", "Number of generation tokens "
                                 "processed.", labels, registry=r)
            self.h_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to "
                                    "first token in seconds.", labels, buckets=_VLLM_TTFT,
                                    registry=r)  # fmt: skip
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         ["block_size", "cache_dtype", "enable_prefix_caching",
                          "num_gpu_blocks", "engine"], registry=r)  # fmt: skip
            info.labels("16", "auto", "True", str(KV_TOKENS // 16), "0").set(1)
        elif engine == "sglang":
            labels = ["model_name"]
            self.values = (MODEL,)
            self.g_running = Gauge("sglang:num_running_reqs", "The number of running requests.",
                                   labels, registry=r)  # fmt: skip
            self.g_waiting = Gauge("sglang:num_queue_reqs", "The number of requests in the "
                                   "waiting queue.", labels, registry=r)
            self.g_kv = Gauge("sglang:token_usage", "The token usage.", labels, registry=r)
            self.g_hit = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", labels,
                               registry=r)  # fmt: skip
            cap = Gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the "
                        "KV cache pool.", labels, registry=r)
            cap.labels(MODEL).set(KV_TOKENS)
            most = Gauge("sglang:max_running_requests", "Maximum running requests", labels,
                         registry=r)  # fmt: skip
            most.labels(MODEL).set(slots)
            self.g_tput = Gauge("sglang:gen_throughput", "The generation throughput (token/s).",
                                labels, registry=r)  # fmt: skip
            self.c_gen = Counter("sglang:generation_tokens", "Number of generation tokens "
                                 "processed.", labels, registry=r)
            self.h_ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time "
                                    "to first token in seconds.", labels, buckets=_SGLANG_TTFT,
                                    registry=r)  # fmt: skip
        elif engine == "tgi":
            self.values = ()
            self.g_running = Gauge("tgi_batch_current_size", "Current batch size", registry=r)
            self.g_waiting = Gauge("tgi_queue_size", "Current queue size", registry=r)
            self.g_kv = Gauge("tgi_batch_current_max_tokens",
                              "Maximum tokens for the current batch", registry=r)
            self.c_requests = Counter("tgi_request_count", "Total number of requests",
                                      registry=r)  # fmt: skip
            self.h_gen = Histogram("tgi_request_generated_tokens", "Generated tokens per "
                                   "request", buckets=[1, 8, 32, 128, 512], registry=r)
        else:
            raise SystemExit(f"unknown engine {engine!r}")
        self.hits = 0
        self.queries = 0
        for metric in list(vars(self).values()):  # every series exists from the start
            if isinstance(metric, Gauge | Counter | Histogram) and self.values:
                metric.labels(*self.values)

    def _l(self, metric):  # type: ignore[no-untyped-def]
        return metric.labels(*self.values) if self.values else metric

    def render(self) -> bytes:
        e = self.engine
        self._l(self.g_running).set(self.running)
        self._l(self.g_waiting).set(self.waiting)
        if e == "tgi":
            self.g_kv.set(self.running * 2048)
        else:
            self._l(self.g_kv).set(self.running / self.slots * 0.5)
        if e == "sglang":
            self._l(self.g_hit).set(self.hits / self.queries if self.queries else 0.0)
        return generate_latest(self.registry)

    async def serve_one(self, prefix: str, hold: float) -> None:
        queued = time.monotonic()
        self.waiting += 1
        try:
            await self.gate.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            hit = bool(prefix) and prefix in self.seen
            self.seen.add(prefix)
            self.queries += 1
            self.hits += hit
            if self.engine == "vllm":
                self._l(self.c_queries).inc(100)
                if hit:
                    self._l(self.c_hits).inc(100)
            if self.engine != "tgi":
                self._l(self.h_ttft).observe(time.monotonic() - queued)
            await asyncio.sleep(hold)
            if self.engine == "tgi":
                self.c_requests.inc()
                self.h_gen.observe(TOKENS_PER_REQUEST)
            else:
                self._l(self.c_gen).inc(TOKENS_PER_REQUEST)
        finally:
            self.running -= 1
            self.gate.release()


ENGINE = web.AppKey("engine", Engine)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def work(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    await request.read()
    hold = float(request.query.get("hold", engine.hold))
    await engine.serve_one(request.query.get("prefix", ""), hold)
    return web.json_response({"engine": engine.engine, "tokens": TOKENS_PER_REQUEST})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--hold", type=float, default=0.2)
    args = parser.parse_args()
    app = web.Application()
    app[ENGINE] = Engine(args.engine, args.slots, args.hold)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", work)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()

