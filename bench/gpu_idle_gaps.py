"""Where the GPU waits: the idle gaps between kernels in a torch profiler trace, and what the
host threads were doing during each.

    python bench/gpu_idle_gaps.py TRACE.json[.gz] [--min-ms 0.3] [--top 15]

For every gap of at least --min-ms between consecutive GPU kernels (or memcpys), prints its
length, the host operation that launched the kernel ending the gap (and its thread), and the
host operations that were running on any thread during the gap, longest first. The sum of
the gaps is the time the GPU spent idle inside the traced steps.

First it prints the idle time by the size of the gap: up to 20 us is a kernel following
another already queued (inside a CUDA graph's replay, about 1-2 us a kernel), 20-150 us a
chain of kernels issued one by one while the GPU waits for the host to launch each, longer a
wait (for the host to reach the next piece of work, or for a peer's data).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=0.3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--compute-only", action="store_true",
                    help="leave NCCL kernels out: a receive kernel that waits for its data is not work")
    args = ap.parse_args()
    events = [e for e in load(args.trace) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if args.compute_only:
        nccl = [e for e in gpu if "nccl" in e["name"].lower()]
        print(f"NCCL kernels left out: {len(nccl)}, {sum(e['dur'] for e in nccl) / 1e3:.1f} ms resident in all")
        gpu = [e for e in gpu if "nccl" not in e["name"].lower()]
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation", "cuda_runtime")]
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    # Every idle stretch, measured from the latest end so far (kernels of several streams may
    # overlap): its length, start, end and the kernel that ends it.
    idle = []
    ended = gpu[0]["ts"]
    for e in gpu:
        if e["ts"] > ended:
            idle.append((e["ts"] - ended, ended, e["ts"], e))
        ended = max(ended, e["ts"] + e["dur"])
    sizes = collections.Counter()
    for dur, *_ in idle:
        sizes["<= 20 us" if dur <= 20 else "20-150 us" if dur <= 150 else "> 150 us"] += dur
    print(f"kernel time {sum(e['dur'] for e in gpu) / 1e3:.1f} ms; idle between kernels: "
          + ", ".join(f"{k} {sizes[k] / 1e3:.1f} ms" for k in ("<= 20 us", "20-150 us", "> 150 us")))
    gaps = [g for g in idle if g[0] >= args.min_ms * 1e3]
    total = sum(g[0] for g in gaps)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    print(f"GPU span {span / 1e3:.1f} ms, kernels {len(gpu)}, idle in gaps >= {args.min_ms} ms: "
          f"{total / 1e3:.1f} ms in {len(gaps)} gaps")
    by_cause = collections.Counter()
    for dur, start, end, nxt in sorted(gaps, reverse=True)[: args.top]:
        launch = launches.get(nxt["args"].get("correlation"))
        print(f"\n-- gap {dur / 1e3:.2f} ms, ended by {nxt['name'][:60]!r}"
              + (f" launched at +{(launch['ts'] - start) / 1e3:.2f} ms on tid {launch['tid']}" if launch else ""))
        during = collections.Counter()
        for h in host:
            overlap = min(end, h["ts"] + h["dur"]) - max(start, h["ts"])
            if overlap > 0:
                during[(h["tid"], h["name"][:70])] += overlap
        for (tid, name), us in during.most_common(8):
            print(f"     {us / 1e3:7.2f} ms  tid {tid}  {name}")
    for dur, start, end, nxt in gaps:
        for h in host:
            overlap = min(end, h["ts"] + h["dur"]) - max(start, h["ts"])
            if overlap > 0 and h.get("cat") == "cuda_runtime":
                by_cause[h["name"]] += overlap
    print("\nCUDA runtime calls overlapping the gaps (ms):")
    for name, us in by_cause.most_common(10):
        print(f"  {us / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
