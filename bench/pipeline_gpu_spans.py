"""What each rank's GPU ran, and for which microbatch: a torch profiler trace joined with the
smp timeline of the same run.

    SMDDP_TIMELINE=/tmp/tl torchrun ... bench/pipeline_profile.py --trace-dir traces/ --only smp_interleaved
    python bench/pipeline_gpu_spans.py traces/smp_interleaved_m4.rank{0,1}.json.gz --timeline /tmp/tl

Each kernel is matched to the smp compute span (a microbatch's forward, backward or served call)
in which the host launched it, by time: a rank holds one compute span at a time (the compute
token), while the launching thread may be another (autograd runs backward on its own device
thread). Prints,
per rank, one line per span with kernels: when its kernels ran on the GPU (ms from the first
kernel of any rank, one clock for a host), their busy time, and the host span; and NCCL kernels
per stream. Gaps between lines are where that GPU had no compute.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def smp_spans(prefix, rank, to_trace_us):
    """Sorted [(start, end, name)] in the torch trace's clock."""
    data = load(f"{prefix}.smp.rank{rank}.json")
    offset = data.get("wallMinusPerfCounterUs")
    if offset is None:
        raise SystemExit(f"{prefix}.smp.rank{rank}.json has no clock offset (written before this script)")
    spans = []
    for e in data["traceEvents"]:
        if e.get("cat") == "compute":
            start = to_trace_us(e["ts"] + offset)
            spans.append((start, start + e["dur"], e["name"]))
    return sorted(spans)


def span_of(spans, ts):
    i = bisect.bisect_right(spans, (ts, float("inf"), "")) - 1
    if i >= 0 and spans[i][0] <= ts <= spans[i][1]:
        return spans[i]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+", help="torch profiler traces, one per rank (rank<N> in the name)")
    ap.add_argument("--timeline", required=True, help="the SMDDP_TIMELINE prefix of the same run")
    ap.add_argument("--min-ms", type=float, default=0.05, help="leave out spans with less GPU time")
    args = ap.parse_args()
    ranks = []
    for path in args.traces:
        data = load(path)
        rank = int(re.search(r"rank(\d+)", path).group(1))
        base_us = data.get("baseTimeNanoseconds", 0) / 1e3
        ranks.append((rank, data["traceEvents"], lambda wall_us, b=base_us: wall_us - b))
    t0 = min(e["ts"] for _, ev, _ in ranks for e in ev if e.get("cat") == "kernel")
    for rank, events, to_trace in ranks:
        spans = smp_spans(args.timeline, rank, to_trace)
        launches = {e["args"].get("correlation"): e for e in events
                    if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
        gpu = sorted((e for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
        groups = {}  # span (or NCCL stream) -> [first start, last end, busy us, kernels, host span]
        for k in gpu:
            if "nccl" in k["name"].lower():
                key = (f"nccl stream {k['args'].get('stream')}", k["ts"])
                host = None
            else:
                launch = launches.get(k["args"].get("correlation"))
                span = span_of(spans, launch["ts"]) if launch else None
                key = (span[2], span[0]) if span else ("(outside smp spans)", None)
                host = span
            g = groups.setdefault(key, [k["ts"], k["ts"] + k["dur"], 0.0, 0, host])
            g[0], g[1] = min(g[0], k["ts"]), max(g[1], k["ts"] + k["dur"])
            g[2] += k["dur"]
            g[3] += 1
        print(f"=== rank {rank}: GPU from / to (ms), busy ms, kernels, label, host span from / to")
        for (label, _), (a, b, busy, n, host) in sorted(groups.items(), key=lambda kv: kv[1][0]):
            if busy < args.min_ms * 1e3 and not label.startswith("nccl"):
                continue
            hs = f"  host {(host[0] - t0) / 1e3:8.2f} / {(host[1] - t0) / 1e3:8.2f}" if host else ""
            print(f"{(a - t0) / 1e3:8.2f} {(b - t0) / 1e3:8.2f} {busy / 1e3:6.2f} {n:5d}  {label[:48]:48s}{hs}")


if __name__ == "__main__":
    main()
