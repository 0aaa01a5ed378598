"""Text rendering for the CLI: the `sluice status` tables, the `sluice snapshot`
listing, and the live view `sluice run` keeps on the terminal.

Pure functions from `ops.ServiceView` / `ReadySnapshot` to strings; `LiveView`
is the only stateful piece (what it printed last, to redraw or to diff).
Everything shown came from Redis, and some of it from a proxy's Redis user (proxy ids):
every cell and every line goes through `_safe`, so a terminal escape sequence is
printed as `\x1b...` text, never executed (no retitled window, no cleared screen, no
fake row).
Times are wall-clock seconds (`time.time()`), passed in as `now`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TextIO

from controlplane.ops import ReplicaStatusView, ServiceView
from controlplane.store.untrusted import printable
from proxy.wire.engines import EngineStats
from proxy.wire.snapshot import ReadySnapshot

_NONE = "-"
_CELL_LIMIT = 256  # characters of one table cell
_LINE_LIMIT = 100_000


def _safe(text: str) -> str:
    """Every line of `text` with its control characters escaped."""
    return "\n".join(printable(line, _LINE_LIMIT) for line in text.split("\n"))


def duration(seconds: float) -> str:
    """A short human duration: 45s, 3m 5s, 2h 10m, 4d 1h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def ago(at: float | None, now: float) -> str:
    """`3m 5s ago`, or `-` when there is no time."""
    return _NONE if not at else f"{duration(now - at)} ago"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, like Sky Serve's tables."""
    rows = [[printable(cell, _CELL_LIMIT) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [list(headers), *rows]
    ]
    return "\n".join(lines)


def versions(view: ServiceView) -> str:
    """`1`, or `1,2` while two versions serve, or `-` when none does."""
    return ",".join(str(v) for v in view.active_versions) or _NONE


def services_table(views: Sequence[ServiceView], now: float, *, verbose: bool = False) -> str:
    """Sky Serve's service columns: name, version(s) active, uptime, status, ready/total
    replicas, endpoint; `verbose` adds the policy and the update mode."""
    headers = ["NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT"]
    rows = [
        [
            v.name,
            versions(v),
            duration(v.uptime),
            v.status,
            f"{v.ready}/{v.total}",
            v.endpoint or _NONE,
        ]
        + ([v.policy, v.update_mode] if verbose else [])
        for v in views
    ]
    return table(headers + (["POLICY", "UPDATE_MODE"] if verbose else []), rows)


def _engine_cells(e: EngineStats | None) -> list[str]:
    """ENGINE, RUNNING, WAITING, KV, TTFT p50/p99 of one replica (`-`: not reported)."""
    if e is None:
        return [_NONE] * 5
    if e.error is not None and e.running is None:
        return ["unknown", _NONE, _NONE, _NONE, _NONE]

    def num(v: float | None) -> str:
        return _NONE if v is None else f"{v:g}"

    kv = _NONE if e.kv_usage is None else f"{e.kv_usage * 100:.0f}%"
    if e.kv_capacity_tokens is not None:
        kv = f"{e.kv_capacity_tokens} tok" if e.kv_usage is None else (
            f"{kv} of {e.kv_capacity_tokens}")
    ttft = _NONE
    if e.ttft_p50 is not None and e.ttft_p99 is not None:
        ttft = f"{e.ttft_p50 * 1000:.0f}/{e.ttft_p99 * 1000:.0f}ms"
    return [e.engine, num(e.running), num(e.waiting), kv, ttft]


def _replica_row(service: str, r: ReplicaStatusView, now: float, verbose: bool = False,
                 engine: EngineStats | None = None) -> list[str]:  # fmt: skip
    row = [
        service,
        str(r.id),
        str(r.version),
        r.url or _NONE,
        ago(r.launched_at, now),
        r.infra or _NONE,
        r.resources or _NONE,
        r.status if r.inflight is None else f"{r.status} (draining {r.inflight} in flight)",
    ]
    if verbose:
        row += [r.backend, r.accelerator or _NONE, "yes" if r.spot else "no",
                ago(r.first_ready_at, now)]  # fmt: skip
        row += _engine_cells(engine)
    return row


def replicas_table(views: Sequence[ServiceView], now: float, *, verbose: bool = False) -> str:
    """Every replica of `views`: Sky Serve's columns (service, id, version, endpoint,
    launched, infra, resources, status); `verbose` adds backend, accelerator, spot and
    when it was first ready, and the engine's telemetry: running and waiting requests, KV
    usage (of its capacity in tokens), TTFT p50/p99 over the last scrape interval."""
    headers = ["SERVICE_NAME", "ID", "VERSION", "ENDPOINT", "LAUNCHED", "INFRA", "RESOURCES",
               "STATUS"]
    if verbose:
        headers += ["BACKEND", "ACCELERATOR", "SPOT", "FIRST_READY", "ENGINE", "RUNNING",
                    "WAITING", "KV", "TTFT_P50/P99"]  # fmt: skip
    rows = [_replica_row(v.name, r, now, verbose, v.engines.get(str(r.id)))
            for v in views for r in v.replicas]  # fmt: skip
    return table(headers, rows)


def scaling_line(view: ServiceView) -> str:
    """`Autoscaling from 1 to 4 replicas (target QPS per replica: 2.0); target 2 replicas
    (upscale, QPS 5.1)`: the policy, the current target and why."""
    line = view.autoscaling or ""
    if view.target is not None:
        line += f"; target {view.target} replica{'s' if view.target != 1 else ''}"
    decision = view.autoscaler
    if decision is not None:
        if decision.qps is not None:
            line += f" ({decision.reason}, QPS {decision.qps:.2f})"
        elif decision.inflight is not None:
            line += f" ({decision.reason}, in flight {decision.inflight:g})"
        elif decision.queue is not None:
            line += f" ({decision.reason}, engine queue {decision.queue:g})"
        elif decision.kv_usage is not None:
            line += f" ({decision.reason}, KV usage summed {decision.kv_usage:.2f})"
        else:
            line += f" ({decision.reason})"
    return line


def proxies_table(views: Sequence[ServiceView], now: float) -> str:
    """One row per proxy process: the generation it serves, since when, how far behind."""
    rows = []
    for view in views:
        for p in view.proxies:
            lag = "-" if not p.lag_generations else (
                f"{p.lag_generations} gen, {p.lag_seconds:.1f}s")
            rows.append([
                view.name, p.id, str(p.generation), lag, ago(p.applied_at, now),
                ago(p.seen_at, now), "yes" if p.connected else "NO",
                "LAGGING" if p.lagging else "ok",
            ])
    return table(["SERVICE", "PROXY", "GENERATION", "BEHIND", "APPLIED", "HEARTBEAT",
                  "REDIS", "STATE"], rows)


def status_text(views: Sequence[ServiceView], now: float, *, verbose: bool = False) -> str:
    """What `sluice status` prints: the services, why any stopped launching, the replicas
    (`verbose`: `sluice status -v`, more columns)."""
    if not views:
        return "No services."
    parts = ["Services", services_table(views, now, verbose=verbose)]
    notes = [f"{v.name}: {scaling_line(v)}" for v in views if v.autoscaling]
    notes += [f"{v.name}: {v.launch_blocked}" for v in views if v.launch_blocked]
    for v in views:
        lagging = sum(1 for p in v.proxies if p.lagging)
        if lagging:
            notes.append(f"{v.name}: {lagging} of {len(v.proxies)} proxies lagging behind "
                         f"generation {v.generation}")
    if notes:
        parts += ["", *notes]
    parts += ["", "Service Replicas"]
    if any(v.replicas for v in views):
        parts.append(replicas_table(views, now, verbose=verbose))
    else:
        parts.append("No replicas.")
    if any(v.proxies for v in views):
        parts += ["", "Proxies", proxies_table(views, now)]
    return _safe("\n".join(parts))


def snapshot_text(snapshot: ReadySnapshot, now: float) -> str:
    """A ReadySnapshot as a header line and a replica table."""
    active = ",".join(str(v) for v in snapshot.active_versions) or _NONE
    published = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.published_at))
    head = (
        f"service {snapshot.service}  generation {snapshot.generation}  "
        f"status {snapshot.status}  policy {snapshot.policy}  active versions {active}\n"
        f"published {published} ({ago(snapshot.published_at, now)})"
    )
    head = _safe(head)
    if not snapshot.replicas:
        return f"{head}\nNo ready replicas."
    rows = [
        [
            str(r.id),
            str(r.version),
            r.url,
            r.accelerator or _NONE,
            _NONE if r.target_qps is None else f"{r.target_qps:g}",
            "yes" if r.spot else "no",
        ]
        for r in snapshot.replicas
    ]
    return f"{head}\n" + table(["ID", "VERSION", "URL", "ACCELERATOR", "TARGET_QPS", "SPOT"], rows)


#: Replica states whose line says why, and where the replica's log is.
_EXPLAINED = ("NOT_READY", "PREEMPTED", "FAILED", "FAILED_INITIAL_DELAY", "FAILED_PROBING",
              "FAILED_PROVISION", "FAILED_CLEANUP")


def replica_change(r: ReplicaStatusView) -> str:
    """`replica 2 (version 1, http://127.0.0.1:4100): FAILED: process exited with code 3
    (log: /path/replica-2.log)`: a replica's new state, why, and its log."""
    line = f"replica {r.id} (version {r.version}, {r.url or 'no url yet'}): {r.status}"
    if r.status in _EXPLAINED:
        if r.reason:
            own = f"replica {r.id} (v{r.version}): "
            line += f": {r.reason.removeprefix(own)}"
        if r.log:
            line += f" (log: {r.log})"
    return line


class LiveView:
    """The replicas of one service coming up, on a terminal or in a log.

    On a TTY it redraws a small table in place on every `update`; otherwise it
    prints one line per change (service status, a replica's status), so piped
    output stays readable.
    """

    def __init__(self, out: TextIO, *, tty: bool) -> None:
        self._out = out
        self._tty = tty
        self._drawn = 0  # lines of the last redraw
        self._service_status: str | None = None
        self._replicas: dict[int, str] = {}

    def update(self, view: ServiceView, now: float) -> None:
        if self._tty:
            self._redraw(view, now)
        else:
            self._print_changes(view, now)

    def message(self, text: str) -> None:
        """A line that stays (above the live table on a TTY)."""
        self.clear()
        print(_safe(text), file=self._out, flush=True)

    def clear(self) -> None:
        """Erase the live table (TTY only), e.g. before the shutdown messages."""
        if self._tty and self._drawn:
            self._out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._out.flush()
            self._drawn = 0

    def _redraw(self, view: ServiceView, now: float) -> None:
        text = (
            f"{view.name}: {view.status}, {view.ready}/{view.total} ready, "
            f"version {versions(view)}, up {duration(view.uptime)}"
        )
        if view.launch_blocked:
            text += f"\n{view.launch_blocked}"
        if view.replicas:
            rows = [_replica_row(view.name, r, now)[1:] for r in view.replicas]
            headers = ["ID", "VERSION", "ENDPOINT", "LAUNCHED", "INFRA", "RESOURCES", "STATUS"]
            text += "\n" + table(headers, rows)
            text += "".join(f"\n{replica_change(r)}" for r in view.replicas
                            if r.status in _EXPLAINED)  # fmt: skip
        lines = _safe(text).split("\n")
        self.clear()
        self._out.write("\n".join(lines) + "\n")
        self._out.flush()
        self._drawn = len(lines)

    def _print_changes(self, view: ServiceView, now: float) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        lines = []
        if view.status != self._service_status:
            self._service_status = view.status
            lines.append(f"{stamp} {view.name}: {view.status} ({view.ready}/{view.total} ready)")
        seen = {}
        for r in view.replicas:
            seen[r.id] = r.status
            if self._replicas.get(r.id) != r.status:
                lines.append(f"{stamp} {replica_change(r)}")
        for gone in sorted(set(self._replicas) - set(seen)):
            lines.append(f"{stamp} replica {gone}: removed")
        self._replicas = seen
        if lines:
            print(_safe("\n".join(lines)), file=self._out, flush=True)
