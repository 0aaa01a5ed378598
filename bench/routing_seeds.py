"""Median and range over seeds of bench/routing.py --json outputs, as markdown tables.

    python bench/routing_seeds.py bench/results/main-s1.json bench/results/main-s2.json ...

Files with the same arguments but the seed (and --json) form one group; for each
workload and target it prints mean TTFT, p99 TTFT, fleet hit rate and load imbalance
as "median (min to max)" over the seeds, plus requests and errors summed.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing import TARGETS


def cell(values: list[float], fmt: str) -> str:
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))} to {fmt.format(max(values))})")


def main(paths: list[str]) -> int:
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        data = json.loads(Path(path).read_text())
        a = data["args"]
        key = ", ".join(f"{k}={a[k]}" for k in ("prompts", "zipf", "duration", "warmup",
                                                  "time_scale", "sluice_args"))
        groups[key].append(data)
    for key, runs in groups.items():
        seeds = sorted(r["args"]["seed"] for r in runs)
        workloads: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for r in runs:
            for w, per in r["summaries"].items():
                for t, s in per.items():
                    workloads[w][t].append(s)
        for w, per in workloads.items():
            print(f"\n#### {w}: {key}; seeds {seeds}\n")
            print("| router | seeds | requests | errors | mean TTFT s | p99 TTFT s "
                  "| fleet hit rate % | load imbalance |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for t, ss in per.items():
                label = TARGETS[t].label if t in TARGETS else t
                print(f"| {label} | {len(ss)} | {sum(s['requests'] for s in ss):.0f} "
                      f"| {sum(s['errors'] for s in ss):.0f} "
                      f"| {cell([s['ttft_mean'] for s in ss], '{:.3f}')} "
                      f"| {cell([s['ttft_p99'] for s in ss], '{:.3f}')} "
                      f"| {cell([100 * s['hit_rate'] for s in ss], '{:.1f}')} "
                      f"| {cell([s['imbalance'] for s in ss], '{:.2f}')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
