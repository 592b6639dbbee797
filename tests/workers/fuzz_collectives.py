"""Differential fuzzer: random programs of mixed collectives, every element checked bitwise.

Every rank draws the same program from (seed, program index): a burst of collectives of
random kind, dtype, op, size (log-uniform up to a few MiB, or one element off a size the
core splits at), sync or async, named or matched by call order, some in one engine batch
(fused). Each rank builds every rank's input from the seed and compares its results with
numpy, bit for bit (inputs are chosen so every reduction is exact; see exact.py).

Programs run until rank 0's time is up (it broadcasts the decision, so all ranks stop at
the same program). A failure prints the seed and program index: rerun one program with
`--seed S --program K` under the same layout and knobs.

usage: fuzz_collectives.py [--seed S] [--seconds T] [--program K]
"""
import argparse
import os
import sys
import time

import numpy as np
from exact import assert_exact, exact_reference, make_fractional
from reference import DTYPES, make_input, storage_dtype
from report import report

from smdistributed.common import engine

KINDS = ["allreduce"] * 5 + ["reduce", "reduce_scatter", "broadcast", "allgather", "alltoall", "barrier"]
MAX_BYTES = 3 << 20
# Byte sizes the core splits work at (see size_boundaries.py); sizes near them are favoured.
SPLITS = [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20]


def env_int(name, default):
    return int(os.environ.get(name) or default)


def draw_count(rng, itemsize, P):
    r = rng.random()
    if r < 0.1:
        return int(rng.integers(0, 2 * P + 2))
    if r < 0.45:
        marks = SPLITS + [env_int("SMDDP_SHM_SLOT_BYTES", 4 << 20), env_int("SMDDP_CMA_THRESHOLD", 256 << 10),
                          env_int("SMDDP_FUSION_THRESHOLD", 25 << 20)]
        b = int(rng.choice(marks)) * int(rng.choice([1, 1, 2, P]))
        return max(0, min(MAX_BYTES, b) // itemsize + int(rng.integers(-P - 1, P + 2)))
    return int(np.exp2(rng.uniform(0, np.log2(MAX_BYTES)))) // itemsize


class Program:
    """One burst of operations; `ops` are dicts with everything each rank needs to check."""

    def __init__(self, seed, index, P):
        rng = np.random.default_rng([seed, index])
        self.ops = []
        for i in range(int(rng.integers(1, 13))):
            kind = str(rng.choice(KINDS))
            dtype = str(rng.choice(DTYPES))
            es = np.dtype(storage_dtype(dtype)).itemsize
            op = str(rng.choice(["sum", "sum", "average", "min", "max", "product"]))
            if dtype == "bool" and op == "average":
                op = "max"
            fractional = dtype in ("float16", "bfloat16") and op in ("sum", "average") and rng.random() < 0.5
            spec = dict(i=i, kind=kind, dtype=dtype, op=op, fractional=fractional,
                        count=draw_count(rng, es, P), root=int(rng.integers(0, P)),
                        async_op=bool(rng.random() < 0.6), named=bool(rng.random() < 0.5),
                        out_of_place=bool(rng.random() < 0.3), seed=int(rng.integers(1 << 30)))
            if kind == "reduce_scatter":
                spec["counts"] = [int(c) for c in rng.integers(0, max(1, spec["count"] // P) + 2, P)]
            if kind == "alltoall":
                spec["splits"] = [[int(c) for c in rng.integers(0, max(1, spec["count"] // (P * P)) + 2, P)]
                                  for _ in range(P)]
            if kind == "allgather":
                spec["rows"] = [int(c) for c in rng.integers(0, max(1, spec["count"] // P) + 2, P)]
            self.ops.append(spec)
        self.batch = rng.random() < 0.3  # submit the whole burst as one engine batch

    def describe(self, spec):
        keys = ("kind", "dtype", "op", "count", "root", "async_op", "named", "out_of_place", "fractional")
        return " ".join(f"{k}={spec[k]}" for k in keys)


def input_of(spec, rank, count):
    if spec["fractional"]:
        return make_fractional(spec["dtype"], rank, count, spec["seed"])
    return make_input(spec["dtype"], rank, count, spec["seed"], spec["op"])


def submit(core, spec, P, me, tag):
    """Starts one operation; returns (work or None, check) where check() verifies the result."""
    dt, kind = spec["dtype"], spec["kind"]
    bf = "bfloat16" if dt == "bfloat16" else None
    name = f"{tag}.{spec['i']}" if spec["named"] else None
    a = spec["async_op"]
    if kind == "allreduce" or kind == "reduce":
        n = spec["count"]
        inputs = [input_of(spec, r, n) for r in range(P)]
        x = inputs[me].copy()
        out = np.full(n, 7, storage_dtype(dt)) if spec["out_of_place"] else None
        if kind == "allreduce":
            w = core.allreduce(x, op=spec["op"], out=out, name=name, dtype=bf, async_op=a)
        else:
            w = core.reduce(x, root=spec["root"], op=spec["op"], out=out, name=name, dtype=bf, async_op=a)

        def check():
            result = x if out is None else out
            checked = 0
            if kind == "allreduce" or me == spec["root"]:
                checked += assert_exact(dt, result, exact_reference(dt, spec["op"], inputs), kind)
            if out is not None:
                checked += assert_exact(dt, x, inputs[me], f"{kind} input left unchanged")
            return checked
        return w, check
    if kind == "reduce_scatter":
        counts = spec["counts"]
        inputs = [input_of(spec, r, sum(counts)) for r in range(P)]
        w = core.reduce_scatter(inputs[me].copy(), op=spec["op"], counts=counts, name=name, dtype=bf, async_op=a)
        result = {}

        def check():
            got = result.get("got", w)
            lo = sum(counts[:me])
            return assert_exact(dt, got, exact_reference(dt, spec["op"], inputs)[lo:lo + counts[me]], kind)
        if a:
            return w, lambda: (result.update(got=w.wait()), check())[1]
        return None, check
    if kind == "broadcast":
        n = spec["count"]
        inputs = [input_of(spec, r, n) for r in range(P)]
        x = inputs[me].copy()
        w = core.broadcast(x, root=spec["root"], name=name, dtype=bf, async_op=a)
        return w, lambda: assert_exact(dt, x, inputs[spec["root"]], kind)
    if kind == "allgather":
        rows = spec["rows"]
        inputs = [input_of(spec, r, rows[r] * 3).reshape(rows[r], 3) for r in range(P)]
        w = core.allgather(inputs[me], name=name, dtype=bf, async_op=a)
        want = np.concatenate(inputs)
        if a:
            return w, lambda: assert_exact(dt, w.wait(), want, kind)
        return None, lambda: assert_exact(dt, w, want, kind)
    if kind == "alltoall":
        splits = spec["splits"]
        inputs = [input_of(spec, s, sum(splits[s]) * 2).reshape(-1, 2) for s in range(P)]
        w = core.alltoall(inputs[me], splits=splits[me], name=name, dtype=bf, async_op=a)
        want = np.concatenate([inputs[s][sum(splits[s][:me]):sum(splits[s][:me + 1])] for s in range(P)])
        got_of = (lambda: w.wait()[0]) if a else (lambda: w[0])
        return w if a else None, lambda: assert_exact(dt, got_of(), want, kind)
    w = core.barrier(name=name, async_op=a)
    return w, lambda: 0


def run_program(core, prog, P, me, tag):
    pending = []
    if prog.batch:
        with core.batch():
            pending = [(spec, submit(core, spec, P, me, tag)) for spec in prog.ops]
    else:
        pending = [(spec, submit(core, spec, P, me, tag)) for spec in prog.ops]
    elements = 0
    for spec, (work, check) in pending:
        if work is not None and spec["async_op"] and spec["kind"] not in ("reduce_scatter", "allgather", "alltoall"):
            work.wait()
        try:
            elements += check()
        except AssertionError as e:
            raise AssertionError(f"{tag} op {spec['i']} ({prog.describe(spec)}): {e}") from None
    return elements


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--program", type=int, default=None)
    args = ap.parse_args()
    core = engine.init()
    P, me = core.size, core.rank
    if me == 0:
        print(f"fuzz seed={args.seed} ranks={P} hosts={core.num_hosts}", flush=True)
    deadline = time.monotonic() + args.seconds
    first = args.program if args.program is not None else 0
    index, ops, elements = first, 0, 0
    while True:
        prog = Program(args.seed, index, P)
        try:
            elements += run_program(core, prog, P, me, f"seed={args.seed} program={index}")
        except AssertionError as e:
            report("fuzzed", ok=False, seed=args.seed, program=index, error=str(e))
            os._exit(1)
        ops += len(prog.ops)
        index += 1
        if args.program is not None:
            break
        go_on = np.array([time.monotonic() < deadline], np.uint8)
        core.broadcast(go_on, root=0, name=f"fuzz.continue.{index}")
        if not go_on[0]:
            break
    report("fuzzed", ok=True, seed=args.seed, programs=index - first, operations=ops, elements_checked=elements)
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
