"""Chat with a sluice endpoint through the openai client (streamed), e.g. the service of
examples/llm-local.yaml:

    python3 examples/llm_chat.py http://127.0.0.1:8080 "hello there"
"""

from __future__ import annotations

import sys

import openai


def main() -> int:
    endpoint = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
    prompt = sys.argv[2] if len(sys.argv) > 2 else "Tell me about sluices."
    with openai.OpenAI(base_url=f"{endpoint.rstrip('/')}/v1", api_key="unused") as client:
        stream = client.chat.completions.create(
            model="any",  # llama-server serves the one model it loaded
            messages=[{"role": "user", "content": prompt}],
            max_tokens=32,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
