"""Where each rank's host CPU goes in a pipeline benchmark, function by function, across all
its threads: runs a benchmark script unchanged under yappi (CPU clock, C functions included)
and prints per rank the CPU time of each thread and the functions with the most CPU, both
their own (`own`) and with what they call (`incl`), in microseconds per microbatch.

    torchrun --nproc_per_node 2 bench/smp_yappi.py --per 320 \\
        bench/pipeline_bench.py --pipelines interleaved --graphs --no-eager --only smp --micro 16

Counts the timed steps of the benchmark's first configuration, as smp_host_probe.py does
(from the second reset of the GPU's peak-memory counters to the third); `--all-steps`
counts everything (CPU runs). yappi slows Python code more than C code, so read the figures
as shares of one rank's host work, not as times a step. Needs `pip install yappi`.
"""
import atexit
import os
import runpy
import sys

import yappi

from timed_window import on_timed_steps

TOP = 45


def install(all_steps: bool) -> None:
    yappi.set_clock_type("cpu")
    if all_steps:
        yappi.start(builtins=True)
        return

    def start():
        yappi.clear_stats()
        yappi.start(builtins=True)
    on_timed_steps(start, yappi.stop)


def report(per: int) -> None:
    yappi.stop()
    rank = os.environ.get("RANK", "0")
    threads = sorted(yappi.get_thread_stats(), key=lambda t: -t.ttot)
    lines = [f"[yappi rank {rank}] thread {t.name:20s} cpu_us/mb={t.ttot / per * 1e6:9.1f}" for t in threads[:12]]
    funcs = list(yappi.get_func_stats())

    def label(f):
        return f"{f.name} ({os.path.basename(f.module)}:{f.lineno})"
    for key, what in (("tsub", "own"), ("ttot", "incl")):
        for f in sorted(funcs, key=lambda f: -getattr(f, key))[:TOP]:
            lines.append(f"[yappi rank {rank}] {what:4s} {getattr(f, key) / per * 1e6:9.1f} us/mb "
                         f"calls/mb={f.ncall / per:6.2f} {label(f)[:110]}")
    print("\n".join(lines), flush=True)


def main():
    argv = sys.argv[1:]
    all_steps = bool(argv) and argv[0] == "--all-steps"
    argv = argv[1:] if all_steps else argv
    per = 1
    if len(argv) >= 2 and argv[0] == "--per":  # microbatches counted (steps x m), for "per mb"
        per, argv = int(argv[1]), argv[2:]
    if not argv:
        sys.exit("usage: smp_yappi.py [--all-steps] [--per N] SCRIPT [ARGS...]")
    install(all_steps)
    atexit.register(report, per)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
