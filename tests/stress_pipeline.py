"""Repeats pipeline training-equivalence worlds for a while, to catch what fails rarely (a hang
once in tens of worlds, say). Not a test pytest collects; run it by hand, on GPUs or CPUs:

    python3 tests/stress_pipeline.py SECONDS [--procs 4] [--cpu]

Each world is tests/workers/smp_pipeline.py checked against one process (parameters within
1e-5). A world still running after --hang-s seconds is stopped and every rank's Python stacks
are printed (tests/world.py's guard), with the stall reports (SMDDP_STALL_WARNING=10) the
ranks logged meanwhile. The cases cycle through manual and automatic partitions, both
schedules, and a model that is not a plain sequence; with 4 processes they run as pp=2 x dp=2.
"""
import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from world import run_world  # noqa: E402

CASES = [["seqparts", "manual", "interleaved", "2", "8", "30"],
         ["skip", "manual", "interleaved", "2", "12", "30"],
         ["seq", "auto", "simple", "2", "8", "30"],
         ["seq", "manual", "interleaved", "2", "4", "40"]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("seconds", type=float)
    ap.add_argument("--procs", type=int, default=4, choices=[2, 4], help="2: pp=2; 4: pp=2 x dp=2")
    ap.add_argument("--cpu", action="store_true", help="run the ranks on CPUs (default: one GPU each)")
    ap.add_argument("--hang-s", type=float, default=90)
    args = ap.parse_args()
    start, worlds, bad = time.time(), 0, 0
    for case in itertools.cycle(CASES):
        if time.time() - start > args.seconds:
            break
        began = time.time()
        try:
            results = run_world(args.procs, "smp_pipeline.py", case, gpus=not args.cpu, timeout=args.hang_s,
                                env={"SMP_TEST_MOVED_BEFORE_WRAP": "1", "SMDDP_STALL_WARNING": "10"})
        except AssertionError as e:  # the hang guard: every live rank's stacks
            print(f"HANG {' '.join(case)}\n{str(e)[-12000:]}")
            results = None
        failed = [r for r in results or [] if r.returncode != 0]
        for r in failed:
            print(f"--- rank {r.rank} exited {r.returncode}\n{r.output[-3000:]}")
        ok = results is not None and not failed and all(r.event("trained")["param_rel_err"] < 1e-5 for r in results)
        worlds += 1
        bad += not ok
        print(f"world {worlds} {' '.join(case)}: {'ok' if ok else 'FAILED'} in {time.time() - began:.1f} s", flush=True)
    print(f"stress: {worlds} worlds, {bad} failed, {time.time() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
