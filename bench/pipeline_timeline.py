"""Where a pipeline step's time goes, from the smp timeline (SMDDP_TIMELINE=PREFIX):

    python bench/pipeline_timeline.py PREFIX [ranks]

For the last `--window-ms` of each rank's trace: the share of time some task held the
compute token (CPU time issuing work), and the order of compute spans (who ran when).
"""
import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("prefix")
p.add_argument("--ranks", type=int, default=2)
p.add_argument("--window-ms", type=float, default=0, help="analyse only the trace's last N ms")
p.add_argument("--show", type=int, default=40)
p.add_argument("--merged", type=float, default=0, help="also print the last N ms of all ranks on one time axis")
args = p.parse_args()

for r in range(args.ranks):
    events = json.load(open(f"{args.prefix}.smp.rank{r}.json"))["traceEvents"]
    end = max(e["ts"] + e["dur"] for e in events)
    start = end - args.window_ms * 1e3 if args.window_ms else min(e["ts"] for e in events)
    shown = [e for e in events if e["ts"] >= start]
    compute = [e for e in shown if e["cat"] == "compute"]
    sends = [e for e in shown if e["cat"] == "send"]
    busy = sum(e["dur"] for e in compute)
    print(f"rank {r}: window {(end - start) / 1e3:.1f} ms, compute token held {busy / 1e3:.1f} ms "
          f"({100 * busy / (end - start):.0f}%), {len(compute)} compute spans, "
          f"sends {sum(e['dur'] for e in sends) / 1e3:.1f} ms")
    for e in sorted(compute, key=lambda e: e["ts"])[-args.show:]:
        print(f"   {(e['ts'] - start) / 1e3:8.2f} +{e['dur'] / 1e3:6.2f} ms  {e['name']}")

if args.merged:  # both ranks on one clock (one host): who computes when, side by side
    spans = []
    for r in range(args.ranks):
        for e in json.load(open(f"{args.prefix}.smp.rank{r}.json"))["traceEvents"]:
            if e["cat"] == "compute" and e["dur"] >= 50:
                spans.append((e["ts"], e["dur"], r, e["name"]))
    end = max(t + d for t, d, _, _ in spans)
    start = end - args.merged * 1e3
    print(f"\nlast {args.merged} ms, spans of 0.05 ms or more (time, length, rank, task):")
    for t, d, r, name in sorted(s for s in spans if s[0] >= start):
        print(f"   {(t - start) / 1e3:8.2f} +{d / 1e3:6.2f} ms  {'    ' * r}rank {r} {name}")
