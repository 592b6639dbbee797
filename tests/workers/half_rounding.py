"""float16/bfloat16 sums across hosts are accumulated in float32 and rounded once.

Rank r contributes VALUES[r] at element 0 (the case that summed to 0.0 when every ring hop
rounded to float16) and random full-mantissa values elsewhere; all ranks check bitwise.
"""
import sys

import numpy as np
from exact import assert_exact, exact_reference, make_fractional

from smdistributed.common import engine

VALUES = [1.4609375, 0.09039306640625, -1.5517578125]


def main():
    core = engine.init()
    P, me = core.size, core.rank
    for dtype in ("float16", "bfloat16"):
        bf = "bfloat16" if dtype == "bfloat16" else None
        for op in ("sum", "average"):
            for n in (1, 3, 1000, 300_001):
                inputs = [make_fractional(dtype, r, n, 11 + n) for r in range(P)]
                if dtype == "float16":
                    for r in range(P):
                        inputs[r][0] = np.float16(VALUES[r % len(VALUES)])
                x = inputs[me].copy()
                core.allreduce(x, op=op, dtype=bf)
                want = exact_reference(dtype, op, inputs)
                assert_exact(dtype, x, want, f"allreduce {dtype} {op} n={n}")
                if dtype == "float16" and op == "sum" and P == 3:
                    assert x[0] == np.float16(-0.00042724609375), x[0]
    print(f"rank {me}: half precision rounded once, hosts={core.num_hosts}", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
