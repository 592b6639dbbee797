"""What NCCL kernels resident beside the compute cost it: from a torch profiler trace.

A pipeline stage's sends and receives run as NCCL kernels on their own streams. A receive
waits on the GPU for its data and holds its SMs meanwhile, so the stage's own kernels that run
beside it have fewer SMs. This compares each compute kernel's mean duration while an NCCL
kernel is resident with the same kernel's mean duration alone, and sums the excess.

    python bench/nccl_beside_cost.py TRACE.json[.gz] [TRACE ...] [--top 10]

Only kernels with at least 4 runs each way count; the excess is (mean beside - mean alone) x
runs beside, over the trace (bench/pipeline_profile.py traces 2 steps).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json


def kernels(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def nccl_intervals(ks):
    """The union of the NCCL kernels' intervals, sorted and disjoint."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks if "nccl" in e["name"].lower())
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlaps(merged, starts, a, b) -> bool:
    i = bisect.bisect_right(starts, b) - 1  # the last interval starting before b ends
    return i >= 0 and merged[i][1] > a


def report(path, top):
    ks = kernels(path)
    merged = nccl_intervals(ks)
    starts = [a for a, _ in merged]
    runs = collections.defaultdict(lambda: ([], []))  # name -> (alone, beside) durations in us
    for e in ks:
        if "nccl" in e["name"].lower():
            continue
        runs[e["name"]][overlaps(merged, starts, e["ts"], e["ts"] + e["dur"])].append(e["dur"])
    rows, excess, beside_total = [], 0.0, 0.0
    for name, (alone, beside) in runs.items():
        beside_total += sum(beside)
        if len(alone) < 4 or len(beside) < 4:
            continue
        mean_alone, mean_beside = sum(alone) / len(alone), sum(beside) / len(beside)
        excess += (mean_beside - mean_alone) * len(beside)
        rows.append(((mean_beside - mean_alone) * len(beside), name, len(alone), mean_alone, len(beside), mean_beside))
    compute = sum(sum(a) + sum(b) for a, b in runs.values())
    print(f"{path}: compute kernels {compute / 1e3:.2f} ms, {beside_total / 1e3:.2f} ms of them beside NCCL; "
          f"excess beside NCCL {excess / 1e3:.2f} ms ({100 * excess / compute:.1f}% of the compute)")
    for cost, name, na, ma, nb, mb in sorted(rows, reverse=True)[:top]:
        print(f"  {cost / 1e3:6.2f} ms  {name[:64]:64s} alone {na:4d} x {ma:6.1f} us, beside {nb:4d} x {mb:6.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    for path in args.traces:
        report(path, args.top)


if __name__ == "__main__":
    main()
