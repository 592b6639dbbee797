"""Reductions at every size boundary of the intra-host and cross-host algorithms, checked bitwise.

The native core switches algorithm or splits work at several sizes: the staging slot (a
piece per round), the small-piece shortcut (64 KiB, every rank reduces the whole piece),
the per-rank chunk of a piece, the cross-memory-attach threshold and its 128 KiB read
block, the fusion threshold and the ring threshold. Each is crossed here by one element
either way, for allreduce, reduce and reduce_scatter, in several dtypes. Inputs are small
integers (16-bit float sums: full mantissas of a narrow range, exact in float32), so every
sum is exact and the result must equal numpy's bit for bit (AVERAGE: exact sum, then one
true division; float16/bfloat16 accumulate in float32 and round once).
"""
import os
import sys

import numpy as np
from reference import storage_dtype
from exact import assert_exact, exact_reference, make_fractional, small_ints
from report import report

from smdistributed.common import engine

# One of each reduction kernel family: same-precision float and integer, the two 16-bit floats.
DTYPES = ["float32", "int8", "float16", "bfloat16"]
ITEM = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def boundary_counts(dtype: str, local_size: int, limit_bytes: int):
    """Element counts one either side of every byte boundary the core splits at."""
    es = ITEM[dtype]
    slot = env_int("SMDDP_SHM_SLOT_BYTES", 4 << 20)
    bounds = {
        64 << 10,                                   # small-piece shortcut of the staging path
        slot, 2 * slot,                             # one and two staging rounds
        env_int("SMDDP_CMA_THRESHOLD", 256 << 10),  # staging -> cross-memory attach
        128 << 10, local_size * (128 << 10),        # attach's read block, once and per rank
        env_int("SMDDP_FUSION_THRESHOLD", 25 << 20),
        env_int("SMDDP_RING_THRESHOLD", 512 << 10),  # hierarchical -> flat ring across hosts
    }
    counts = {0, 1, local_size - 1, local_size + 1, 64 // es * local_size + 1}
    for b in bounds:
        n = b // es
        for c in (n - 1, n, n + 1, n + local_size, n * local_size // max(1, local_size - 1) + 1):
            counts.add(c)
    return sorted(c for c in counts if 0 <= c and c * es <= limit_bytes)


def main():
    core = engine.init()
    P, me = core.size, core.rank
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 3 << 20
    checked = 0
    seed = 0
    for dtype in DTYPES:
        bf = "bfloat16" if dtype == "bfloat16" else None
        # Every rank must draw the same sizes: take the boundaries of every host's local size.
        per_host = -(-P // core.num_hosts)
        local_sizes = {per_host, P - (core.num_hosts - 1) * per_host}
        sizes = sorted(set().union(*(boundary_counts(dtype, L, limit) for L in local_sizes if L > 0)))
        for n in sizes:
            for op in ("sum", "average", "max") if dtype == "float32" else ("sum", "average"):
                seed += 1
                # 16-bit float sums get full mantissas: rounding more than once shows.
                half_sum = dtype in ("float16", "bfloat16") and op != "max"
                inputs = [(make_fractional if half_sum else small_ints)(dtype, r, n, seed) for r in range(P)]
                x = inputs[me].copy()
                core.allreduce(x, op=op, dtype=bf)
                assert_exact(dtype, x, exact_reference(dtype, op, inputs), f"allreduce {dtype} {op} n={n}")
                checked += n
            seed += 1
            root = seed % P
            inputs = [small_ints(dtype, r, n, seed) for r in range(P)]
            out = np.zeros(n, storage_dtype(dtype))
            core.reduce(inputs[me].copy(), root=root, op="sum", out=out, dtype=bf)
            if me == root:
                assert_exact(dtype, out, exact_reference(dtype, "sum", inputs), f"reduce {dtype} n={n} root={root}")
            # reduce_scatter of n elements in all: split as evenly as possible, and unevenly
            # (rank r's block grows with r, the last takes the rest).
            even = [n // P + (r < n % P) for r in range(P)]
            uneven = [min(n, n * 2 * (r + 1) // (P * (P + 1))) for r in range(P - 1)]
            uneven.append(n - sum(uneven))
            for counts in (even, uneven):
                seed += 1
                inputs = [small_ints(dtype, r, sum(counts), seed) for r in range(P)]
                got = core.reduce_scatter(inputs[me].copy(), op="sum", counts=counts, dtype=bf)
                lo = sum(counts[:me])
                want = exact_reference(dtype, "sum", inputs)[lo:lo + counts[me]]
                assert_exact(dtype, got, want, f"reduce_scatter {dtype} counts={counts}")
                checked += counts[me]
    report("exact", elements_checked=checked, local_size=core.local_size, hosts=core.num_hosts)
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
