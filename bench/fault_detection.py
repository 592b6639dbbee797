"""How long after a fault every surviving rank raises, and whether it names the right rank.

    python bench/fault_detection.py [--rounds 3] [--timeout 4]

Faults: a rank SIGKILLed during a large allreduce (tests/workers/dead_peer.py) and a rank
stopped with SIGSTOP (alive, sockets open, silent: tests/workers/stalled_peer.py), each for
the coordinator (rank 0) and another rank, on one host and on two simulated hosts (TCP
between them); and a rank stopped while the others wait on point-to-point receives from it
(SIGSTOP-p2p: a pipeline stage's wait, told by its engine no longer answering pings). The
victim prints its wall time as it fails, the survivors theirs as they raise; on one machine
the clocks are the same. A stall can only be told from slowness by
the timeout (SMDDP_TIMEOUT), so its figure is the timeout plus the detection delay; a death
needs no timeout. Writes bench/results/fault_detection.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from world import run_world  # noqa: E402

SCENARIOS = [  # (fault, worker, ranks, hosts, victim)
    ("SIGKILL", "dead_peer.py", 3, 1, 2), ("SIGKILL", "dead_peer.py", 3, 1, 0),
    ("SIGKILL", "dead_peer.py", 4, 2, 3), ("SIGKILL", "dead_peer.py", 4, 2, 0),
    ("SIGSTOP", "stalled_peer.py", 4, 1, 2), ("SIGSTOP", "stalled_peer.py", 4, 1, 0),
    ("SIGSTOP", "stalled_peer.py", 4, 2, 3), ("SIGSTOP", "stalled_peer.py", 4, 2, 0),
    ("SIGSTOP-p2p", "stalled_peer.py", 4, 1, 2), ("SIGSTOP-p2p", "stalled_peer.py", 4, 2, 3),
]


def run_once(fault, worker, n, hosts, victim, timeout):
    args = (["during", str(victim)] if worker == "dead_peer.py"
            else [str(victim), "p2p" if fault == "SIGSTOP-p2p" else "announced"])
    results = run_world(n, worker, args, env={"SMDDP_TIMEOUT": str(timeout)}, hosts=hosts,
                        kill_after_others=[victim] if fault.startswith("SIGSTOP") else (), timeout=120)
    faults = results[victim].events("fault")
    delays, named = [], 0
    for r in results:
        if r.rank == victim:
            continue
        raised = r.events("raised")
        if not raised or not faults:
            return None
        delays.append(raised[0]["at"] - faults[0]["at"])
        message = raised[0]["message"]
        named += (f"rank {victim}" in message or f"rank(s) {victim}" in message)
    return {"slowest_s": max(delays), "fastest_s": min(delays), "named": named, "survivors": n - 1}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "results" / "fault_detection.json"))
    args = ap.parse_args()
    rows = []
    for fault, worker, n, hosts, victim in SCENARIOS:
        runs = [run_once(fault, worker, n, hosts, victim, args.timeout) for _ in range(args.rounds)]
        ok = [r for r in runs if r]
        row = {"fault": fault, "ranks": n, "hosts": hosts, "victim": victim, "runs": len(runs),
               "runs_where_every_survivor_raised": len(ok),
               "survivors_naming_the_victim": f"{sum(r['named'] for r in ok)}/{sum(r['survivors'] for r in ok)}",
               "slowest_survivor_s_worst_run": max((r["slowest_s"] for r in ok), default=None),
               "slowest_survivor_s_median_run": sorted(r["slowest_s"] for r in ok)[len(ok) // 2] if ok else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'fault':11} {'ranks':>5} {'hosts':>5} {'victim':>6} {'every rank raised':>18} {'named':>7} "
          f"{'median s':>9} {'worst s':>8}")
    for r in rows:
        med, worst = r["slowest_survivor_s_median_run"], r["slowest_survivor_s_worst_run"]
        print(f"{r['fault']:11} {r['ranks']:>5} {r['hosts']:>5} {r['victim']:>6} "
              f"{r['runs_where_every_survivor_raised']:>9}/{r['runs']:<8} {r['survivors_naming_the_victim']:>7} "
              f"{med if med is None else round(med, 2):>9} {worst if worst is None else round(worst, 2):>8}")
    Path(args.out).write_text(json.dumps({
        "benchmark": "time from a fault to the last surviving rank's error",
        "command": "python bench/fault_detection.py " + " ".join(sys.argv[1:]),
        "smddp_timeout_s": args.timeout,
        "machine": {"nproc": os.cpu_count(), "processor": platform.machine(), "python": platform.python_version()},
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
