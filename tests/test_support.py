"""The shared test support itself: the poller's contract and the port helper."""

from __future__ import annotations

import socket

import pytest

from tests.support.poll import retrying, until, until_sync
from tests.support.ports import BLOCK, HOST, free_port


async def test_until_returns_the_first_truthy_value_of_a_sync_or_async_check() -> None:
    calls: list[int] = []

    def sync_check() -> list[int] | None:
        calls.append(1)
        return calls if len(calls) == 3 else None

    assert await until(sync_check, timeout=5, interval=0) == [1, 1, 1]

    async def async_check() -> str:
        return "ready"

    assert await until(async_check, timeout=5) == "ready"


async def test_until_names_what_it_waited_for_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"after 0.05s waiting for the thing; last: 0"):
        await until(lambda: 0, timeout=0.05, what="the thing", interval=0.01)


async def test_an_error_in_the_check_fails_at_once() -> None:
    def check() -> bool:
        raise AssertionError("the process died")

    with pytest.raises(AssertionError, match="the process died"):
        await until(check, timeout=60)


def test_until_sync_has_the_same_contract() -> None:
    values = iter([None, "", "done"])
    assert until_sync(lambda: next(values), timeout=5, interval=0) == "done"
    with pytest.raises(AssertionError, match="waiting for nothing; last: False"):
        until_sync(lambda: False, timeout=0.05, what="nothing", interval=0.01)


async def test_retrying_retries_only_the_named_errors_and_gives_up_with_the_last() -> None:
    attempts: list[int] = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError(f"attempt {len(attempts)}")
        return "ok"

    assert await retrying(flaky, on=(ConnectionError,), interval=0) == "ok"

    async def broken() -> None:
        raise ConnectionError("still down")

    with pytest.raises(ConnectionError, match="still down"):
        await retrying(broken, on=(ConnectionError,), timeout=0.05, interval=0.01)

    async def wrong() -> None:
        raise ValueError("not retried")

    with pytest.raises(ValueError):
        await retrying(wrong, on=(ConnectionError,), timeout=60)


def test_free_ports_are_unlistened_distinct_and_consecutive_when_asked() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    first = free_port(3)
    assert not {first, first + 1, first + 2} & set(ports)
    for port in (*ports, first, first + 1, first + 2):
        with socket.socket() as s:
            assert s.connect_ex((HOST, port)) != 0  # nothing listens there


def test_each_xdist_worker_hands_out_ports_from_its_own_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers can never both find one port free: worker i of n takes only ports in
    blocks of BLOCK whose number is i modulo n, and a run of ports never crosses a block."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    seen: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        index = int(worker[2:])
        mine = seen.setdefault(worker, set())
        for count in (1, 1, 4, BLOCK):
            first = free_port(count)
            ports = set(range(first, first + count))
            assert {p // BLOCK % 3 for p in ports} == {index}
            mine |= ports
    assert not (seen["gw0"] & seen["gw1"] or seen["gw1"] & seen["gw2"]
                or seen["gw0"] & seen["gw2"])
    # Outside the kernel's ephemeral range, where outgoing connections take their ports.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(v) for v in f.read().split())
    handed = set().union(*seen.values())
    assert not any(lo <= p <= hi for p in handed), sorted(handed)
    with pytest.raises(ValueError, match="count must be"):
        free_port(BLOCK + 1)
