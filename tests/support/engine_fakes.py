"""Processes of the fake engine-metrics replica (tests/support/engine_fake.py), and the
`engine_fakes` fixture (a factory, closed at teardown)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.processes import HOST, Process, _Factory, closed_after


class EngineFake(Process):
    """One fake-format engine process on a free port (`url`, `port`, `engine`)."""

    def __init__(self, engine: str, port: int, log_dir: Path, slots: int, hold: float) -> None:
        self.engine, self.port = engine, port
        self.url = f"http://{HOST}:{port}"
        argv = [sys.executable, "-m", "tests.support.engine_fake", "--port", str(port),
                "--engine", engine, "--slots", str(slots), "--hold", str(hold)]  # fmt: skip
        super().__init__(argv, log_dir / f"engine-fake-{engine}-{port}.log", None)


class EngineFakeFactory(_Factory):
    """Starts fake-format engines; `close()` stops every one it started."""

    async def astart(
        self, engine: str, *, slots: int = 2, hold: float = 0.2, n: int = 1
    ) -> list[EngineFake]:
        fakes = [EngineFake(engine, free_port(), self.log_dir, slots, hold) for _ in range(n)]
        self.started += fakes
        await self._wait_async([(f, f.port, "/health", True) for f in fakes], 15.0,
                               f"engine fake ({engine})")  # fmt: skip
        return fakes


@pytest.fixture
def engine_fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFakeFactory]:
    yield from closed_after(EngineFakeFactory(tmp_path_factory.mktemp("engine-fakes")), 5.0)
