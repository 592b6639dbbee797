"""Demo of the native core: run it under the launcher, e.g.

    smddprun -np 2 python examples/core_demo.py

Every rank runs each collective once and checks the result, then rank 0 prints an
allreduce latency/bandwidth table (float32, in place) measured through the engine.
"""
import argparse
import time

import numpy as np

from smdistributed.common import engine


def check_collectives(core):
    P, me = core.size, core.rank
    x = np.full(1000, me + 1.0, np.float32)
    core.allreduce(x, op="average", name="demo.avg")
    assert np.allclose(x, (P + 1) / 2)
    b = np.full(8, me, np.int64)
    core.broadcast(b, root=P - 1, name="demo.bcast")
    assert np.all(b == P - 1)
    g = core.allgather(np.full((me + 1, 2), me, np.int32), name="demo.gather")
    assert g.shape == (P * (P + 1) // 2, 2)
    rs = core.reduce_scatter(np.ones(4 * P, np.float64), name="demo.rs")
    assert np.all(rs == P)
    out, rows = core.alltoall(np.full((P, 3), me, np.float32), name="demo.a2a")
    assert rows == [1] * P and np.array_equal(out[:, 0], np.arange(P, dtype=np.float32))
    core.barrier(name="demo.barrier")


def measure(core, nbytes, budget_s):
    x = np.ones(nbytes // 4, np.float32)
    t0 = time.perf_counter()
    for _ in range(3):
        core.allreduce(x, name="bw")
    # Every rank must run the same number of iterations: rank 0 decides and broadcasts it.
    iters = np.array([max(5, min(2000, int(budget_s / ((time.perf_counter() - t0) / 3))))], np.int64)
    core.broadcast(iters, root=0, name="iters")
    times = []
    for _ in range(int(iters[0])):
        t0 = time.perf_counter()
        core.allreduce(x, name="bw")
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mb", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per size")
    args = ap.parse_args()
    core = engine.init()
    check_collectives(core)
    if core.rank == 0:
        print(f"{core.size} ranks on {core.num_hosts} host(s): allreduce, broadcast, allgather, "
              "reduce_scatter, alltoall and barrier checked", flush=True)
        print(f"{'size':>10} {'latency (us)':>14} {'bandwidth (GB/s)':>18}", flush=True)
    nbytes = 4096
    while nbytes <= args.max_mb << 20:
        t = measure(core, nbytes, args.budget)
        if core.rank == 0:
            label = f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
            print(f"{label:>10} {t * 1e6:14.1f} {nbytes / t / 1e9:18.2f}", flush=True)
        nbytes *= 4
    if core.rank == 0:
        c = core.counters()
        print(f"engine counters: {c['completed']} operations, {c['negotiation_round_trips']} negotiation "
              f"round trips, {c['cache_hits']} announced by cache id", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
