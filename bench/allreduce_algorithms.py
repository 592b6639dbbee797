"""Flat ring vs hierarchical allreduce across (simulated) hosts, to choose SMDDP_RING_THRESHOLD.

Runs the core alone with 4 ranks posing as 2 hosts x 2 (smddprun --simulate-hosts 2):
shared memory inside a "host", TCP over loopback between them. Each algorithm is forced
with SMDDP_ALGORITHM in its own job; the table shows where hierarchical starts to win.

    python bench/allreduce_algorithms.py [--sizes 4K,64K,1M,16M] [--out bench/results/allreduce_algorithms]

On a real cluster TCP crosses a network instead of loopback, which favours the hierarchical
algorithm (one TCP ring among host leaders) even more; rerun this there to tune.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def run_algorithm(algorithm: str, sizes, np_, hosts, seconds) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        env = dict(os.environ, SMDDP_ALGORITHM=algorithm)
        cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", str(np_), "--simulate-hosts",
               str(hosts), "--", sys.executable, str(HERE / "allreduce_worker.py"), "--impl", "smddp",
               "--sizes", ",".join(map(str, sizes)), "--seconds", str(seconds), "--rounds", "2", "--out", out]
        subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())["results"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help="comma-separated sizes (K/M suffixes)")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.4)
    p.add_argument("--out", default=str(HERE / "results" / "allreduce_algorithms"))
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    t0 = time.time()
    results = {a: run_algorithm(a, sizes, args.np, args.hosts, args.seconds) for a in ("ring", "hierarchical")}
    rows = []
    print(f"{'size':>8} {'ring us':>10} {'hier us':>10} {'faster':>14}")
    for i, size in enumerate(sizes):
        ring, hier = results["ring"][i], results["hierarchical"][i]
        assert ring["correct"] and hier["correct"], (ring, hier)
        faster = "hierarchical" if hier["median_us"] < ring["median_us"] else "ring"
        ratio = max(ring["median_us"], hier["median_us"]) / min(ring["median_us"], hier["median_us"])
        label = f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"
        print(f"{label:>8} {ring['median_us']:10.1f} {hier['median_us']:10.1f} {faster:>12} {ratio:.2f}x")
        rows.append({"bytes": size, "ring_us": ring["median_us"], "hierarchical_us": hier["median_us"]})
    crossover = next((r["bytes"] for r in rows if r["hierarchical_us"] < r["ring_us"]), None)
    print(f"hierarchical wins from {crossover} bytes" if crossover else "ring won at every size")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({
        "benchmark": "allreduce ring vs hierarchical, simulated hosts",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "np": args.np, "hosts": args.hosts, "machine": {"nproc": os.cpu_count()},
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "duration_s": time.time() - t0,
        "rows": rows, "first_size_where_hierarchical_wins": crossover,
    }, indent=1))
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
