"""tests/support/llama.py itself: the model file is written once and atomically, is a
model llama-server loads, never emits byte or control tokens, and servers start with
the flags asked for and stop by pid."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support import llama
from tests.support.pids import running
from tests.support.ports import HOST
from tests.support.processes import REPO


def test_model_is_written_once_and_parallel_writers_never_clash(tmp_path: Path) -> None:
    # Four processes race to write the same model into an empty cache directory.
    code = "import sys; from pathlib import Path; from tests.support import llama; " \
        "print(llama.model_path(Path(sys.argv[1])))"  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE
        )
        for _ in range(4)
    ]
    paths = {p.communicate(timeout=60)[0].decode().strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    (path,) = paths
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"{llama.MODEL_VERSION}.gguf"]
    before = Path(path).stat().st_mtime_ns
    assert llama.model_path(tmp_path) == Path(path)
    assert Path(path).stat().st_mtime_ns == before  # not rewritten


def test_byte_and_control_tokens_have_zero_output_rows(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(llama.model_path(tmp_path)))
    output = next(t for t in reader.tensors if t.name == "output.weight")
    rows = np.asarray(output.data).reshape(-1, llama.N_EMBD)
    _, types = llama._vocab()
    assert rows.shape[0] == len(types) == 354
    for i, kind in enumerate(types):
        assert (not rows[i].any()) == (kind != 1), (i, kind)


def _post(url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        result: dict[str, object] = json.loads(resp.read())
        return result


def test_servers_start_with_the_asked_slots_report_timings_and_stop_by_pid(
    llama_factory: llama.LlamaFactory,
) -> None:
    servers = llama_factory(2, slots=3, ctx=1536)
    assert len({s.port for s in servers}) == 2
    a = servers[0]
    assert [s["n_ctx"] for s in a.slots()] == [512, 512, 512]
    prompt = "the quick brown fox " * 10
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    first = _post(a.url, "/v1/chat/completions", body)
    again = _post(a.url, "/v1/chat/completions", body)
    t1, t2 = llama.timings(first), llama.timings(again)
    assert t1.cache_n == 0 and t1.prompt_n > 200
    assert t2.cache_n == t1.prompt_n - 1 and t2.prompt_n == 1  # all but the last token reused
    usage = first["usage"]
    assert isinstance(usage, dict) and usage["completion_tokens"] == 16  # no early EOS
    text = first["choices"][0]["message"]["content"]  # type: ignore[index]
    assert text == again["choices"][0]["message"]["content"]  # type: ignore[index]
    assert a.metrics()["llamacpp:prompt_tokens_total"] == t1.prompt_n + t2.prompt_n
    assert a.busy_slots() == 0

    a.stop()
    assert not running(a.pid)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{HOST}:{a.port}/health", timeout=2)
    assert servers[1].slots()  # the other one still serves


def test_unavailable_is_none_on_x86_64_linux_with_the_wheel() -> None:
    import platform

    if platform.machine() != "x86_64" or sys.platform != "linux":
        assert llama.unavailable() and "x86_64 Linux only" in str(llama.unavailable())
    else:
        assert llama.unavailable() is None
