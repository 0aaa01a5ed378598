"""examples/llm-local.yaml as README.md tells a new user to run it: the real `sluice
run` CLI (embedded redis-server, controller, proxy) starts two llama-server replicas on
$PORT, readiness on their /health; the openai client gets a chat completion through the
endpoint; Ctrl-C (SIGINT) stops the model servers themselves."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from tests.support import llama
from tests.support.cli import spawn_sluice
from tests.support.pids import descendants, kill_all, running
from tests.support.poll import until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO

EXAMPLE = REPO / "examples" / "llm-local.yaml"


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def _pgid(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rfind(")") + 2 :].split()[2])
    return None


@pytest.mark.slow
def test_sluice_run_of_the_llm_example_answers_the_openai_client(tmp_path: Path) -> None:
    reason = llama.unavailable()
    if reason:
        pytest.skip(reason)
    import openai

    llama.model_path()  # what the replicas would write on first start, written once here
    port, log = free_port(), tmp_path / "run.log"
    argv = ["run", str(EXAMPLE), "--state-dir", str(tmp_path / "state"), "--host", HOST,
            "--port", str(port), "--drain-seconds", "0", "--down-timeout", "30"]  # fmt: skip
    if llama.OVERRIDE in os.environ:  # replicas never see the host's SLUICE_* variables
        argv += ["--env", llama.OVERRIDE]
    run = spawn_sluice(argv, log)
    servers: list[int] = []
    try:

        state = tmp_path / "state" / "llm-local"

        def engines() -> list[int]:
            """The pids the controller recorded for the replicas, once both are
            llama-server (the one process the controller signals)."""
            assert run.poll() is None, f"sluice run exited:\n{log.read_text()}"
            pids = []
            for i in (1, 2):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    pids.append(json.loads((state / f"replica-{i}.json").read_text())["pid"])
            return pids if len(pids) == 2 and all(_comm(p) == "llama-server" for p in pids) else []

        # python exec'd llama-server: the replica's pid (its process group) is the model
        # server itself, so the controller's SIGTERM reaches it.
        servers = until_sync(engines, timeout=60, what="two llama-server replicas")
        assert all(_pgid(pid) == pid for pid in servers)

        with openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="unused",
                           max_retries=0, timeout=30) as client:  # fmt: skip

            def answer() -> str | None:
                assert run.poll() is None, f"sluice run exited:\n{log.read_text()}"
                with contextlib.suppress(openai.APIError):
                    reply = client.chat.completions.create(
                        model="any", messages=[{"role": "user", "content": "hello"}],
                        max_tokens=8,
                    )  # fmt: skip
                    return reply.choices[0].message.content
                return None

            text = until_sync(answer, timeout=60, what="a chat completion", interval=0.5)
        assert text and len(text) >= 8

        run.send_signal(signal.SIGINT)  # Ctrl-C
        assert run.wait(60) == 0, log.read_text()
        assert not any(running(pid) for pid in servers)
    finally:
        if run.poll() is None:
            kill_all([run.pid, *descendants(run.pid)])
            run.wait(10)
        kill_all(servers)
