"""Median and range over seeds of bench/routing.py --json outputs, as markdown tables.

    python bench/routing_seeds.py bench/results/main-s1.json bench/results/main-s2.json ...

Files with the same arguments but the seed (and --json) form one group; for each
workload and target it prints mean TTFT, p99 TTFT, fleet hit rate and load imbalance
as "median (min to max)" over the seeds, plus requests and errors summed. With
--goals, also issue 25's goals per seed: sluice `prefix` (1 and 4 proxies on Redis)
against the best peer of that seed (mean and p99 TTFT <=, hit rate >= best - 1 point;
a miss also shows the prompt tokens computed against the peers' fewest: no more means
no cache lost to the peers, the gap being in how the load spread or within the spread of
runs),
4 proxies within 5 % of 1 (mean TTFT, hit rate), `prefix` against `least_load` on
unique prompts.
"""

from __future__ import annotations

import argparse
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


PEERS = ("sglang-ca1", "smg-ca", "smg-ca-nop", "vllm-ca")
X1, X4 = "sluice-prefix-redis", "sluice-prefix-redis-x4"


def tokens_note(s: dict, peers: list[dict]) -> str:
    """For a miss: the prompt tokens `s` computed against the fewest of the peers that
    report theirs ("" when either does not)."""
    counts = [p["computed"] for p in peers if "computed" in p]
    if "computed" not in s or not counts:
        return ""
    fewest = min(counts)
    note = f"; prompt tokens {s['computed']:,} vs the peers' fewest {fewest:,}"
    if s["computed"] <= fewest:
        note += " (no more: no cache lost; the gap is in spreading load, or the run's spread)"
    return note


def goals(w: str, per_seed: dict[int, dict[str, dict]]) -> list[str]:
    out = []
    for seed, per in sorted(per_seed.items()):
        peers = [per[p] for p in PEERS if p in per]
        notes = []
        if w == "nosharing" and "sluice-least_load" in per:
            ll = per["sluice-least_load"]
            for t in (X1, X4):
                if t in per:
                    s = per[t]
                    notes.append(f"{t} vs least_load: mean {s['ttft_mean']:.3f}/"
                                 f"{ll['ttft_mean']:.3f} p99 {s['ttft_p99']:.3f}/"
                                 f"{ll['ttft_p99']:.3f} "
                                 + ("ok" if s["ttft_mean"] <= ll["ttft_mean"] * 1.05
                                    else "WORSE"))
        if peers:
            best_mean = min(p["ttft_mean"] for p in peers)
            best_p99 = min(p["ttft_p99"] for p in peers)
            best_hit = max(p["hit_rate"] for p in peers)
            for t in (X1, X4):
                if t not in per:
                    continue
                s = per[t]
                fails = [name for name, bad in (
                    ("mean", s["ttft_mean"] > best_mean),
                    ("p99", s["ttft_p99"] > best_p99),
                    ("hit", s["hit_rate"] < best_hit - 0.01)) if bad]
                notes.append(f"{t}: mean {s['ttft_mean']:.3f} vs {best_mean:.3f}, p99 "
                             f"{s['ttft_p99']:.3f} vs {best_p99:.3f}, hit "
                             f"{100 * s['hit_rate']:.1f} vs {100 * best_hit:.1f}: "
                             + ("met" if not fails else "not met (" + ", ".join(fails) + ")"
                                + tokens_note(s, peers)))
        if X1 in per and X4 in per:
            a, b = per[X1], per[X4]
            dm = b["ttft_mean"] / a["ttft_mean"] - 1
            dh = b["hit_rate"] / a["hit_rate"] - 1 if a["hit_rate"] else 0.0
            notes.append(f"x4 vs x1: mean TTFT {100 * dm:+.0f} %, hit {100 * dh:+.1f} % "
                         + ("within 5 %" if dm <= 0.05 and dh >= -0.05 else "NOT within 5 %"))
        out.extend(f"- seed {seed}: {n}" for n in notes)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Runs of one seed may be split over several files (sluice in one, the "
               "peers in another): their targets are merged per seed.")
    ap.add_argument("paths", nargs="+", metavar="JSON", help="bench/routing.py --json files")
    ap.add_argument("--goals", action="store_true",
                    help="also check issue 25's goals per seed (see above)")
    args = ap.parse_args(argv)
    want_goals = args.goals
    paths = args.paths
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        data = json.loads(Path(path).read_text())
        a = data["args"]
        key = ", ".join(f"{k}={a[k]}" for k in ("prompts", "zipf", "duration", "warmup",
                                                  "time_scale", "sluice_args"))
        groups[key].append(data)
    for key, runs in groups.items():
        seeds = sorted({r["args"]["seed"] for r in runs})
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
            if want_goals:
                per_seed: dict[int, dict[str, dict]] = defaultdict(dict)
                for r in runs:  # a seed's targets may come from several files
                    per_seed[r["args"]["seed"]].update(r["summaries"].get(w, {}))
                print()
                print("\n".join(goals(w, per_seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
