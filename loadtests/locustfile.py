"""Locust load for a sluice endpoint: chat completions (JSON or SSE) and GETs at a fixed rate.

    locust -f loadtests/locustfile.py --headless -u 1 -H http://127.0.0.1:8080 \
        --run-time 60s --sluice-rate 20 --sluice-report /tmp/report.json

**Open loop.** `SluiceUser` is a pacer, not a client that waits for its
replies: its `wait_time` sleeps until the next slot of a fixed schedule
(`start + n / rate`), and each slot spawns the request in its own greenlet. So
the arrival rate is `--sluice-rate` requests per second whatever the replies
do: a hung or slow request never delays the next one (a closed-loop user, or
`constant_throughput` with users = rate, sends less exactly when the service is
in trouble). Slots missed while the process was busy are sent at once (the
average rate holds). With `-u N` the rate is split across the N users. At most
`--sluice-max-in-flight` requests are outstanding; a slot that finds the cap
reached is not sent and counts as lost (`client_overload`).

**Requests**, mixed by `--sluice-mix` (weights, sent in a fixed interleaved
order): `stream` = POST `--sluice-chat-path` with `"stream": true`, reading the
SSE body to its `data: [DONE]` and the end of the body; `chat` = the same
without streaming (one JSON); `get` = GET `--sluice-get-path`.

**Each request ends as exactly one outcome**, counted by a listener on
`events.request` (it also counts requests other users fire):

    ok          2xx, and the whole body read (a stream up to data: [DONE])
    http        a non-2xx status (counted by code)
    cut         2xx, but the body ended or broke before its end (a stream before data: [DONE])
    timeout     no complete answer within --sluice-timeout seconds (a hung request)
    error       no HTTP answer at all (refused, reset before the status line): by class

plus `slow` (any outcome slower than `--sluice-slow-threshold` seconds),
`unfinished` (still in flight when the run stopped, after a wait of one
timeout) and `client_overload`. `lost` = http + cut + timeout + error +
unfinished + client_overload. Latency is to the end of the body.

At the end the counters are logged as a table and, with `--sluice-report FILE`,
written as JSON (the file appears, with `"state": "running"`, when the first
request is sent). Every option is also an env var: `SLUICE_RATE`, `SLUICE_MIX`,
`SLUICE_TIMEOUT`, `SLUICE_SLOW_THRESHOLD`, `SLUICE_MAX_TOKENS`, `SLUICE_CHAT_PATH`,
`SLUICE_GET_PATH`, `SLUICE_MAX_IN_FLIGHT`, `SLUICE_REPORT`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import gevent
import gevent.pool
import locust  # noqa: F401  (before requests: it monkey-patches ssl and sockets)
import requests
from locust import User, events, task
from locust.env import Environment
from requests.adapters import HTTPAdapter

log = logging.getLogger("sluice.locust")

KINDS = ("stream", "chat", "get")
_MAX_SAMPLES = 2000  # failures and slow requests kept (with their time) for diagnosis
_DONE = b"data: [DONE]"


#: (option, env var, type, default, help) of every custom argument.
OPTIONS: tuple[tuple[str, str, type, Any, str], ...] = (
    ("--sluice-rate", "SLUICE_RATE", float, 20.0,
     "requests per second, in total over all users (open loop)"),
    ("--sluice-mix", "SLUICE_MIX", str, "stream:2,chat:1,get:1",
     "request kinds and weights: stream (SSE chat), chat (JSON chat), get"),
    ("--sluice-timeout", "SLUICE_TIMEOUT", float, 20.0,
     "per-request deadline in seconds, to the end of the body"),
    ("--sluice-slow-threshold", "SLUICE_SLOW_THRESHOLD", float, 2.0,
     "requests slower than this many seconds count as slow"),
    ("--sluice-max-tokens", "SLUICE_MAX_TOKENS", int, 32, "max_tokens of chat requests"),
    ("--sluice-chat-path", "SLUICE_CHAT_PATH", str, "/v1/chat/completions",
     "path of chat-completion POSTs"),
    ("--sluice-get-path", "SLUICE_GET_PATH", str, "/v1/models", "path of plain GETs"),
    ("--sluice-max-in-flight", "SLUICE_MAX_IN_FLIGHT", int, 2000,
     "most requests outstanding at once"),
    ("--sluice-report", "SLUICE_REPORT", str, "", "write the counters as JSON to this file"),
)  # fmt: skip


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("sluice", "sluice load (see loadtests/locustfile.py)")
    for name, env, kind, default, text in OPTIONS:
        group.add_argument(name, type=kind, env_var=env, default=default, help=text)


@dataclass(frozen=True)
class Settings:
    rate: float
    mix: tuple[str, ...]  # one full cycle of kinds, interleaved by weight
    timeout: float
    slow: float
    max_tokens: int
    chat_path: str
    get_path: str
    max_in_flight: int
    report: str

    @classmethod
    def from_options(cls, options: Any) -> Settings:
        if options.sluice_rate <= 0:
            raise ValueError("--sluice-rate must be > 0")
        return cls(
            rate=options.sluice_rate,
            mix=parse_mix(options.sluice_mix),
            timeout=options.sluice_timeout,
            slow=options.sluice_slow_threshold,
            max_tokens=options.sluice_max_tokens,
            chat_path=options.sluice_chat_path,
            get_path=options.sluice_get_path,
            max_in_flight=options.sluice_max_in_flight,
            report=options.sluice_report,
        )


def parse_mix(text: str) -> tuple[str, ...]:
    """One cycle of request kinds from a mix such as "stream:2,chat:1,get:1", smoothly
    interleaved (stream chat stream get)."""
    weights: dict[str, int] = {}
    for part in text.split(","):
        name, _, weight = part.strip().partition(":")
        if name not in KINDS:
            raise ValueError(f"--sluice-mix: unknown kind {name!r} (one of {', '.join(KINDS)})")
        if int(weight or 1) < 0:
            raise ValueError(f"--sluice-mix: negative weight for {name}")
        if int(weight or 1) > 0:
            weights[name] = int(weight or 1)
    if not weights:
        raise ValueError("--sluice-mix: the weights add up to 0")
    # Smooth weighted round robin (nginx's): no long runs of one kind.
    current = dict.fromkeys(weights, 0)
    total = sum(weights.values())
    cycle = []
    for _ in range(total):
        for name, weight in weights.items():
            current[name] += weight
        pick = max(current, key=lambda n: current[n])
        current[pick] -= total
        cycle.append(pick)
    return tuple(cycle)


# -- counters ----------------------------------------------------------------------------------


@dataclass
class Recorder:
    """Counts every request of one locust Environment; see the module docstring."""

    settings: Settings | None = None
    sent: int = 0
    completed: int = 0
    unfinished: int = 0
    client_overload: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)  # non-2xx status -> count
    errors: Counter[str] = field(default_factory=Counter)  # error class -> count
    slow: int = 0
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    by_replica: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # seconds
    samples: list[dict[str, Any]] = field(default_factory=list)
    sent_per_second: Counter[int] = field(default_factory=Counter)
    first_sent_at: float | None = None
    last_sent_at: float | None = None
    in_flight: gevent.pool.Group = field(default_factory=gevent.pool.Group)
    stopped: bool = False
    finished: bool = False

    def on_request(
        self,
        context: dict[str, Any] | None = None,
        response_time: float = 0.0,
        exception: Any = None,
        response: Any = None,
        **_kwargs: Any,
    ) -> None:
        """An `events.request` listener: one request ended (response_time in ms)."""
        self.record(dict(context or {}, _response=response), response_time / 1000.0, exception)

    def record(self, context: dict[str, Any], latency: float, exception: Any) -> None:
        outcome = context.get("sluice_outcome")
        status = context.get("sluice_status")
        if outcome is None:  # a request fired by some other user: classify it here
            response = context.get("_response")
            status = getattr(response, "status_code", None)
            if exception is None:
                outcome = "ok"
            elif status and not 200 <= status < 300:
                outcome = "http"
            else:
                outcome = "error"
        self.completed += 1
        self.outcomes[outcome] += 1
        kind = context.get("sluice_kind", "other")
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if outcome == "http":
            self.codes[str(status)] += 1
        elif outcome == "error":
            self.errors[type(exception).__name__ if exception else "unknown"] += 1
        if replica := context.get("sluice_replica"):
            self.by_replica[replica] += 1
        self.latencies.append(latency)
        slow = latency > self.settings.slow if self.settings else False
        self.slow += slow
        if (outcome != "ok" or slow) and len(self.samples) < _MAX_SAMPLES:
            self.samples.append({
                "sent_at": context.get("sluice_sent_at"),
                "kind": kind,
                "outcome": outcome,
                "status": status,
                "latency": round(latency, 3),
                "replica": context.get("sluice_replica"),
                "error": repr(exception)[:300] if exception else None,
            })  # fmt: skip

    def note_sent(self, at: float) -> None:
        self.sent += 1
        self.first_sent_at = self.first_sent_at or at
        self.last_sent_at = at
        self.sent_per_second[int(at)] += 1

    def reset(self) -> None:
        """Zero everything but the settings (a new test started, e.g. from the web UI)."""
        if self.in_flight:
            self.in_flight.kill(block=False)
        self.__dict__.update(Recorder(settings=self.settings).__dict__)

    def finish(self) -> None:
        """Stop sending, give requests in flight one timeout to end, count the rest as
        unfinished, then log and write the report. Idempotent."""
        self.stopped = True
        if self.finished:
            return
        timeout = self.settings.timeout if self.settings else 0.0
        self.in_flight.join(timeout=timeout + 2.0)
        self.unfinished = len(self.in_flight)
        self.in_flight.kill(block=True, timeout=2.0)
        self.finished = True
        summary = self.summary()
        log.info("sluice counters:\n%s", table(summary))
        if self.settings and self.settings.report:
            write_json(self.settings.report, summary)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 1) if lat else None

        # Whole seconds only: the first and last ones are partial.
        seconds = sorted(self.sent_per_second)[1:-1]
        per_second = [self.sent_per_second[s] for s in seconds]
        span = (self.last_sent_at or 0.0) - (self.first_sent_at or 0.0)
        lost = (
            self.outcomes["http"] + self.outcomes["cut"] + self.outcomes["timeout"]
            + self.outcomes["error"] + self.unfinished + self.client_overload
        )  # fmt: skip
        return {
            "state": "finished" if self.finished else "running",
            "rate": self.settings.rate if self.settings else None,
            "sent": self.sent,
            "completed": self.completed,
            "ok": self.outcomes["ok"],
            "non_2xx": dict(sorted(self.codes.items())),
            "cut": self.outcomes["cut"],
            "timeout": self.outcomes["timeout"],
            "errors": dict(sorted(self.errors.items())),
            "unfinished": self.unfinished,
            "client_overload": self.client_overload,
            "slow": self.slow,
            "slow_threshold": self.settings.slow if self.settings else None,
            "lost": lost,
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
            "by_replica": dict(sorted(self.by_replica.items())),
            "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0)},
            "first_sent_at": self.first_sent_at,
            "last_sent_at": self.last_sent_at,
            "achieved_rate": round((self.sent - 1) / span, 2) if span > 0 else None,
            "sent_per_second": {
                "min": min(per_second, default=None),
                "max": max(per_second, default=None),
            },
            "samples": self.samples,
        }


_recorders: WeakKeyDictionary[Environment, Recorder] = WeakKeyDictionary()


def recorder(environment: Environment) -> Recorder:
    """The Recorder of `environment`, made (and hooked to its events) on first use."""
    rec = _recorders.get(environment)
    if rec is None:
        rec = _recorders[environment] = Recorder()
        if environment.parsed_options is not None:
            rec.settings = Settings.from_options(environment.parsed_options)
        environment.events.request.add_listener(rec.on_request)
        environment.events.test_start.add_listener(lambda **_kw: rec.reset())
        # The SIGTERM path fires `quitting` before the users stop, --run-time fires
        # `test_stop` first: finish on whichever comes first (it stops the pacers too).
        environment.events.test_stop.add_listener(lambda **_kw: rec.finish())
        environment.events.quitting.add_listener(lambda **_kw: rec.finish())
    return rec


@events.init.add_listener
def _init(environment: Environment, **_kwargs: Any) -> None:
    recorder(environment)


def write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1)
    os.replace(tmp, path)  # readers never see half a report


def table(summary: dict[str, Any]) -> str:
    rows = [
        ("requests sent", summary["sent"]),
        ("achieved rate (req/s)", summary["achieved_rate"]),
        ("2xx complete", summary["ok"]),
        ("non-2xx by code", summary["non_2xx"] or 0),
        ("cut (body ended early)", summary["cut"]),
        ("timed out (hung)", summary["timeout"]),
        ("no answer, by error", summary["errors"] or 0),
        ("unfinished at stop", summary["unfinished"]),
        ("not sent (in-flight cap)", summary["client_overload"]),
        (f"slower than {summary['slow_threshold']} s", summary["slow"]),
        ("lost", summary["lost"]),
        ("latency ms p50/p99/max", "/".join(str(v) for v in (
            summary["latency_ms"]["p50"], summary["latency_ms"]["p99"],
            summary["latency_ms"]["max"]))),
    ]  # fmt: skip
    return "\n".join(f"  {name:<26} {value}" for name, value in rows)


# -- the user ----------------------------------------------------------------------------------


class _Deadline(gevent.Timeout):
    """The per-request deadline (a BaseException: requests' handlers cannot swallow it)."""


class StreamCut(Exception):
    """A 2xx body that ended or broke before its last event."""


class SluiceUser(User):
    """Sends requests on a fixed schedule (open loop); see the module docstring."""

    def on_start(self) -> None:
        self.rec = recorder(self.environment)
        settings = self.rec.settings
        if settings is None:
            settings = self.rec.settings = Settings.from_options(self.environment.parsed_options)
        self.settings = settings
        runner = self.environment.runner
        users = max(1, getattr(runner, "target_user_count", None) or 1)
        self.period = users / settings.rate
        self.next_due = time.monotonic() + random.uniform(0.0, self.period)
        self.sequence = random.randrange(len(settings.mix))
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=settings.max_in_flight)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        # -H may list several proxies (comma-separated): requests rotate over them.
        self.bases = [h.strip().rstrip("/") for h in (self.host or "").split(",") if h.strip()]
        if not self.bases:
            raise ValueError("no host: pass -H http://HOST:PORT[,http://HOST:PORT...]")

    def on_stop(self) -> None:
        if self.rec.finished:  # else requests in flight still use the session
            self.session.close()

    def wait_time(self) -> float:
        return max(0.0, self.next_due - time.monotonic())

    @task
    def pace(self) -> None:
        now = time.monotonic()
        while self.next_due <= now and not self.rec.stopped:
            self.next_due += self.period
            kind = self.settings.mix[self.sequence % len(self.settings.mix)]
            self.sequence += 1
            self.rec.note_sent(time.time())
            if self.rec.sent == 1 and self.settings.report:
                write_json(self.settings.report, self.rec.summary())  # under way
            if len(self.rec.in_flight) >= self.settings.max_in_flight:
                self.rec.client_overload += 1
                continue
            self.rec.in_flight.spawn(self.one, kind, self.bases[self.sequence % len(self.bases)])

    def one(self, kind: str, base: str) -> None:
        settings = self.settings
        sent_at = time.time()
        context: dict[str, Any] = {"sluice_kind": kind, "sluice_sent_at": round(sent_at, 3)}
        if kind == "get":
            method, path, body = "GET", settings.get_path, None
        else:
            method, path = "POST", settings.chat_path
            body = {
                "model": "sluice/loadtest",
                "messages": [{"role": "user", "content": "Tell me how sluice rolls out."}],
                "max_tokens": settings.max_tokens,
                "stream": kind == "stream",
            }
        status: int | None = None
        length = 0
        exception: BaseException | None = None
        outcome = "ok"
        started = time.perf_counter()
        deadline = _Deadline(settings.timeout)
        deadline.start()
        response = None
        try:
            response = self.session.request(
                method, base + path, json=body, stream=True,
                timeout=(settings.timeout, settings.timeout),
            )  # fmt: skip
            status = response.status_code
            context["sluice_replica"] = response.headers.get("X-Replica-Id")
            try:
                if kind == "stream" and 200 <= status < 300:
                    length = _read_sse(response)
                else:
                    length = len(response.content)
            except _Deadline:
                raise
            except Exception as exc:
                raise StreamCut(f"{type(exc).__name__}: {exc}") from exc
            if not 200 <= status < 300:
                outcome = "http"
                exception = RuntimeError(f"HTTP {status}")
        except _Deadline as exc:
            if exc is not deadline:
                raise
            outcome = "timeout"
            exception = TimeoutError(f"no complete answer in {settings.timeout:g}s")
        except StreamCut as exc:
            outcome, exception = "cut", exc
        except Exception as exc:  # no HTTP answer: refused, reset, bad status line
            outcome, exception = "error", exc
        finally:
            deadline.close()
            if response is not None:
                response.close()
        context.update(sluice_outcome=outcome, sluice_status=status)
        self.environment.events.request.fire(
            request_type=method if kind != "stream" else "POST-SSE",
            name=f"{kind} {path}",
            response_time=(time.perf_counter() - started) * 1000.0,
            response_length=length,
            response=response,
            context=context,
            exception=exception,
        )  # fmt: skip


def _read_sse(response: requests.Response) -> int:
    """Read an SSE body to its end; raise StreamCut unless `data: [DONE]` came and the body
    then ended cleanly. Returns the bytes read."""
    done = False
    length = 0
    for line in response.iter_lines(chunk_size=None):
        length += len(line) + 1
        if line.strip() == _DONE:
            done = True
        elif done and line.strip():
            raise StreamCut("data after [DONE]")
    if not done:
        raise StreamCut("the body ended before data: [DONE]")
    return length
