"""What looking for the engine's cached-token report costs per response chunk
(proxy/outcomes.py; only for services on the `prefix` policy): the exchange's inline
`bytes.find` over a chunk's last 1 KiB, and `cached_tokens()` on a chunk that has a
marker. Best of 5 rounds. Nothing is asserted.

    python bench/outcome_scan.py
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.outcomes import MARKER, SCAN_FROM, cached_tokens

SSE = (b'data: {"id":"chatcmpl-8f3c2a91","object":"chat.completion.chunk","created":1733000000,'
       b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":'
       b'" the"},"logprobs":null,"finish_reason":null}]}\n\n')
# A llama-server (b1-7e4c0a9) chat completion: a usage report and timings.cache_n.
LLAMA = (b'{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant",'
         b'"content":"abcd"}}],"created":1,"model":"m","system_fingerprint":"b1","object":'
         b'"chat.completion","usage":{"completion_tokens":4,"prompt_tokens":264,"total_tokens"'
         b':268,"prompt_tokens_details":{"cached_tokens":0}},"id":"chatcmpl-MXwdHbhYGoV8InA4",'
         b'"timings":{"cache_n":0,"prompt_n":264,"prompt_ms":295.406,"prompt_per_token_ms":'
         b'1.1189621212121212,"prompt_per_second":893.6853009079031,"predicted_n":4,'
         b'"predicted_ms":41.18,"predicted_per_token_ms":13.726666666666667,'
         b'"predicted_per_second":72.85089849441476}}')

FIND = [
    ("100-byte body, no marker", b"x" * 99 + b"\n"),
    (f"{len(SSE)}-byte vLLM SSE event", SSE),
    ("64 KiB chunk, no marker", b"y" * 65536),
]
SCAN = [
    (f"{len(LLAMA)}-byte llama.cpp body (2 reports)", LLAMA),
    ("64 KiB of markers (hostile)", b'{"cache_n":' * 5958),
    ("1 MB digit run (hostile)", b'{"cache_n":' + b"7" * 1_000_000 + b"}"),
]


def best(stmt: str, data: bytes, n: int) -> float:
    env = {"data": data, "MARKER": MARKER, "SCAN_FROM": SCAN_FROM, "cached_tokens": cached_tokens}
    return min(timeit.repeat(stmt, globals=env, number=n, repeat=5)) / n * 1e9


def main() -> None:
    print("| what | chunk | ns |\n|---|---|---:|")
    for name, data in FIND:
        ns = best("data.find(MARKER, SCAN_FROM) >= 0", data, 200_000)
        print(f"| inline find (every chunk) | {name} | {ns:.0f} |")
    for name, data in SCAN:
        ns = best("cached_tokens(data, -1)", data, 20_000)
        print(f"| cached_tokens (a chunk with a marker) | {name} | {ns:.0f} |")


if __name__ == "__main__":
    main()
