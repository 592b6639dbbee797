"""One rank of the allreduce benchmark: times float32 allreduces with the named implementations.

Run by bench/allreduce_bandwidth.py, not by hand (though it works by hand too):

    smddprun -np 2 -- python bench/allreduce_worker.py --impl smddp,gloo --sizes 4096,67108864 --out r.json
    mpirun -np 2 python bench/allreduce_worker.py --impl mpi --sizes 4096,67108864 --out r.json

Implementations:
  smddp  this project's native core (smdistributed.common.engine), numpy buffers in place
  gloo   torch.distributed with the Gloo backend, on torch.from_numpy views of the same buffers
  mpi    mpi4py's Allreduce(MPI.IN_PLACE, ...) on numpy buffers (needs an MPI launcher)

For each size the ranks allocate one buffer and every implementation works on it in
turn, so all of them see the same memory. Per implementation and size: one correctness
check (rank r contributes (r+1) * pattern, the sum must be exact), then --rounds
rounds, the implementations taking turns: each a fixed warmup, then an iteration count
agreed across ranks from the warmup's speed (--seconds / --rounds of work, at least
--min-iters). Every iteration is timed on each rank; the time of an iteration is the
slowest rank's; a round's result is the median over its iterations, and the round with
the lowest median is reported. Rank 0 writes the results as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

PATTERN_LEN = 8  # rank r contributes (r + 1) * [1, 2, ..., 8, 1, 2, ...]


# ----------------------------------------------------------------------------- implementations
#
# Each implementation wraps one library behind the same four calls, so the timing loop
# below is shared and identical for all of them.

class SmddpImpl:
    name = "smddp"

    def __init__(self):
        from smdistributed.common import engine

        self.core = engine.init()
        self.rank, self.size = self.core.rank, self.core.size

    def prepare(self, buf: np.ndarray):
        # A stable name per buffer, as a training step reuses its gradient names: after
        # the first call the core negotiates it by its cached id.
        self._buf = buf
        self._name = f"bench.allreduce.{buf.nbytes}"

    def allreduce(self):
        self.core.allreduce(self._buf, op="sum", name=self._name)

    def agree_max(self, values: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(values, dtype=np.float64).copy()
        self.core.allreduce(out, op="max", name=f"bench.agree.{out.size}")
        return out

    def barrier(self):
        self.core.barrier()

    def close(self):
        pass

    @staticmethod
    def version() -> str:
        try:
            from importlib.metadata import version

            return version("smdistributed-open")
        except Exception:
            return "installed"


class GlooImpl:
    name = "gloo"

    def __init__(self):
        import torch
        import torch.distributed as dist

        # Keep Gloo on the loopback device (smddprun's MASTER_ADDR is 127.0.0.1 anyway).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.torch, self.dist = torch, dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def prepare(self, buf: np.ndarray):
        self._tensor = self.torch.from_numpy(buf)  # shares buf's memory

    def allreduce(self):
        self.dist.all_reduce(self._tensor, op=self.dist.ReduceOp.SUM)

    def agree_max(self, values: np.ndarray) -> np.ndarray:
        t = self.torch.tensor(np.asarray(values, dtype=np.float64))
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.numpy()

    def barrier(self):
        self.dist.barrier()

    def close(self):
        self.dist.destroy_process_group()

    def version(self) -> str:
        return self.torch.__version__


class MpiImpl:
    name = "mpi"

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def prepare(self, buf: np.ndarray):
        self._buf = buf

    def allreduce(self):
        self.comm.Allreduce(self.MPI.IN_PLACE, self._buf, op=self.MPI.SUM)

    def agree_max(self, values: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(values, dtype=np.float64).copy()
        self.comm.Allreduce(self.MPI.IN_PLACE, out, op=self.MPI.MAX)
        return out

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        pass

    def version(self) -> str:
        import mpi4py

        library = self.MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
        return f"mpi4py {mpi4py.__version__}; {library}"


IMPLS = {"smddp": SmddpImpl, "gloo": GlooImpl, "mpi": MpiImpl}


# ----------------------------------------------------------------------------- measurement

def warmup_iters(nbytes: int) -> int:
    """Fixed per size (so every rank agrees without talking): more for cheap sizes."""
    if nbytes >= 16 << 20:
        return 3
    if nbytes >= 1 << 20:
        return 10
    return 50


def fill_contribution(buf: np.ndarray, rank: int) -> None:
    reps = buf.size // PATTERN_LEN
    pattern = np.arange(1, PATTERN_LEN + 1, dtype=np.float32) * np.float32(rank + 1)
    buf.reshape(reps, PATTERN_LEN)[:] = pattern


def check_sum(buf: np.ndarray, size: int) -> tuple[bool, str]:
    """After a SUM allreduce every element must be (1+2+...+size) * pattern, exactly."""
    want = np.arange(1, PATTERN_LEN + 1, dtype=np.float32) * np.float32(size * (size + 1) // 2)
    got = buf.reshape(-1, PATTERN_LEN)
    bad = np.flatnonzero(np.any(got != want, axis=1))
    if bad.size == 0:
        return True, ""
    row = int(bad[0])
    return False, f"{bad.size} of {got.shape[0]} rows wrong; row {row}: got {got[row].tolist()}, want {want.tolist()}"


def check(impl, buf: np.ndarray) -> tuple[bool, str]:
    """One allreduce of rank-dependent values; True on every rank only if all got the exact sum."""
    impl.prepare(buf)
    fill_contribution(buf, impl.rank)
    impl.barrier()
    impl.allreduce()
    ok, detail = check_sum(buf, impl.size)
    ok_all = bool(impl.agree_max(np.array([0.0 if ok else 1.0]))[0] == 0.0)
    # Zeros for the timed runs: the sum stays zero (no overflow to inf over many
    # iterations, no denormals), and the data movement is the same as for any values.
    buf.fill(0)
    return ok_all, detail


def timed_round(impl, buf: np.ndarray, seconds: float, min_iters: int, max_iters: int) -> dict:
    """Warmup, then about `seconds` of allreduces; per-iteration times of the slowest rank."""
    nbytes = buf.nbytes
    impl.prepare(buf)
    nwarm = warmup_iters(nbytes)
    impl.barrier()
    warm = []
    for _ in range(nwarm):
        t0 = time.perf_counter()
        impl.allreduce()
        warm.append(time.perf_counter() - t0)
    per_iter = float(np.median(warm))
    want = int(seconds / max(per_iter, 1e-7))
    iters = int(impl.agree_max(np.array([float(min(max(want, min_iters), max_iters))]))[0])

    times = np.empty(iters, dtype=np.float64)
    impl.barrier()
    start = time.perf_counter()
    for i in range(iters):
        t0 = time.perf_counter()
        impl.allreduce()
        times[i] = time.perf_counter() - t0
    wall = time.perf_counter() - start
    # An iteration lasts as long as its slowest rank saw it last.
    slowest = impl.agree_max(times)
    wall = float(impl.agree_max(np.array([wall]))[0])
    median = float(np.median(slowest))
    return {
        "iters": iters,
        "warmup": nwarm,
        "median_us": median * 1e6,
        "min_us": float(slowest.min()) * 1e6,
        "p90_us": float(np.percentile(slowest, 90)) * 1e6,
        "mean_us": wall / iters * 1e6,
    }


def measure_size(impls, nbytes: int, args) -> list[dict]:
    """All implementations on one shared buffer: checks, then `rounds` rounds of them in turn.

    Interleaving the rounds exposes every implementation to the same moments of the
    machine; the round with the lowest median is kept (the least disturbed one), and
    every round's median is recorded.
    """
    buf = np.empty(nbytes // 4, dtype=np.float32)
    buf.fill(0)  # touch every page before anything is timed
    checks = {impl.name: check(impl, buf) for impl in impls}
    rounds = {impl.name: [] for impl in impls}
    per_round = args.seconds / args.rounds
    for _ in range(args.rounds):
        for impl in impls:
            rounds[impl.name].append(timed_round(impl, buf, per_round, args.min_iters, args.max_iters))
    out = []
    for impl in impls:
        best = min(rounds[impl.name], key=lambda r: r["median_us"])
        ok, detail = checks[impl.name]
        out.append({
            "impl": impl.name,
            "bytes": nbytes,
            "count": nbytes // 4,
            **best,
            "algbw_GBps": nbytes / (best["median_us"] * 1e-6) / 1e9,
            "round_medians_us": [r["median_us"] for r in rounds[impl.name]],
            "correct": ok,
            "error": detail,
        })
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", required=True, help="comma-separated: " + ",".join(IMPLS))
    p.add_argument("--sizes", required=True, help="comma-separated buffer sizes in bytes (multiples of 32)")
    p.add_argument("--seconds", type=float, default=0.5, help="timed work per implementation and size")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size; the best is kept")
    p.add_argument("--min-iters", type=int, default=3, help="per round")
    p.add_argument("--max-iters", type=int, default=20000)
    p.add_argument("--out", help="JSON file rank 0 writes (default: print it)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [s.strip() for s in args.impl.split(",") if s.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        print(f"unknown implementation(s) {unknown}; known: {list(IMPLS)}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s % (4 * PATTERN_LEN):
            print(f"size {s} is not a multiple of {4 * PATTERN_LEN} bytes", file=sys.stderr)
            return 2

    impls = [IMPLS[n]() for n in names]
    rank, size = impls[0].rank, impls[0].size
    for impl in impls[1:]:
        if (impl.rank, impl.size) != (rank, size):
            print(f"{impl.name} sees rank {impl.rank}/{impl.size}, {impls[0].name} {rank}/{size}", file=sys.stderr)
            return 2

    results = []
    for nbytes in sizes:
        for r in measure_size(impls, nbytes, args):
            results.append(r)
            if rank == 0:
                flag = "" if r["correct"] else "  WRONG RESULT"
                rounds = "/".join(f"{m:.1f}" for m in r["round_medians_us"])
                print(f"{r['impl']:>6} {nbytes:>11} B  {r['median_us']:12.1f} us  {r['algbw_GBps']:8.3f} GB/s"
                      f"  ({r['iters']} iters; round medians {rounds} us){flag}", flush=True)
            if r["error"]:
                print(f"{r['impl']} rank {rank}: {r['error']}", file=sys.stderr, flush=True)

    doc = {
        "world_size": size,
        "versions": {impl.name: impl.version() for impl in impls},
        "results": results,
    }
    if rank == 0:
        text = json.dumps(doc, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text)
    for impl in impls:
        impl.barrier()
    for impl in reversed(impls):
        impl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
