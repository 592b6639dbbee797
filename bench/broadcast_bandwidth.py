"""CPU broadcast: this project's core against torch.distributed Gloo, on the same buffers.

    smddprun -np 2 python bench/broadcast_bandwidth.py [--sizes 1M,16M,256M] [--rounds 3] [--out r.json]

Each rank allocates one float32 buffer per size; smddp (the core's numpy API) and Gloo (on a
torch.from_numpy view of the same memory) take turns, --rounds times, each timing --iters
broadcasts from rank 0 after a warmup; a broadcast's time is the slowest rank's, and the best
round's median is reported. Every broadcast is checked (the receivers hold the root's values).
Run it with SMDDP_CMA=0 to time the staging-slot path instead of cross-memory attach.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from smdistributed.common import engine

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def timed(fn, iters: int, core) -> float:
    times = []
    for _ in range(iters):
        core.barrier(name="bench.sync")
        t0 = time.perf_counter()
        fn()
        t = np.array([time.perf_counter() - t0])
        core.allreduce(t, op="max", name="bench.slowest")
        times.append(float(t[0]))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,16M,256M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    core = engine.init()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://")
    me = core.rank
    rows = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        buf = np.zeros(size // 4, np.float32)
        view = torch.from_numpy(buf)
        root_values = np.arange(buf.size, dtype=np.float32) % 1000

        def fill():
            if me == 0:
                buf[:] = root_values
            else:
                buf[:] = -1

        def check(name):
            if not np.array_equal(buf, root_values):
                raise AssertionError(f"{name} broadcast of {size} bytes: wrong values on rank {me}")

        impls = {"smddp": lambda: core.broadcast(buf, root=0, name=f"bench.bcast.{size}"),
                 "gloo": lambda: dist.broadcast(view, src=0)}
        best = {k: float("inf") for k in impls}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                fill()
                fn()  # warmup, checked
                check(name)
                best[name] = min(best[name], timed(fn, args.iters, core))
                check(name)
        row = {"bytes": size, **{f"{k}_s": v for k, v in best.items()},
               **{f"{k}_GBps": size / v / 1e9 for k, v in best.items()}, "speedup": best["gloo"] / best["smddp"]}
        rows.append(row)
        if me == 0:
            print(f"{size:>12} B  smddp {row['smddp_GBps']:6.2f} GB/s  gloo {row['gloo_GBps']:6.2f} GB/s  "
                  f"smddp/gloo speed {row['speedup']:.2f}x", flush=True)
    if me == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": core.size, "cma": os.environ.get("SMDDP_CMA", "auto"), "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    engine.shutdown()


if __name__ == "__main__":
    main()
