"""Single-process in-place vector add (dst += src) with the core's reduce kernel.

This is the memory-bound floor of a CPU allreduce: every allreduce must at least read
the peers' data and add it into its own. Reported like the allreduce numbers, as
buffer bytes / time ("algbw"), and also as the memory traffic the kernel really moves
(read dst, read src, write dst: 3x the buffer). numpy.add(dst, src, out=dst) on the
same buffers is timed too, as a second opinion on what the memory allows.

    python bench/vector_add.py [--bytes 67108864]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def measure_vector_add(nbytes: int = 64 << 20, seconds: float = 0.5, min_iters: int = 5) -> dict:
    from smdistributed import _core

    count = nbytes // 4
    dst = np.zeros(count, dtype=np.float32)
    src = np.ones(count, dtype=np.float32)

    def add():
        _core.reduce_into(dst.ctypes.data, src.ctypes.data, count, _core.DType.float32, _core.ReduceOp.SUM)

    def numpy_add():
        np.add(dst, src, out=dst)

    add()
    if not np.all(dst == 1.0):
        raise RuntimeError("reduce_into did not add src into dst")
    dst.fill(0)  # adding ones into zeros stays exact for far more than the iterations run

    median, iters = _median_time(add, seconds, min_iters)
    numpy_median, _ = _median_time(numpy_add, seconds / 2, min_iters)
    return {
        "bytes": count * 4,
        "iters": iters,
        "median_us": median * 1e6,
        "algbw_GBps": count * 4 / median / 1e9,
        "memory_traffic_GBps": 3 * count * 4 / median / 1e9,
        "numpy_add_median_us": numpy_median * 1e6,
        "numpy_add_algbw_GBps": count * 4 / numpy_median / 1e9,
    }


def _median_time(fn, seconds: float, min_iters: int) -> tuple[float, int]:
    for _ in range(3):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=64 << 20)
    p.add_argument("--seconds", type=float, default=0.5)
    args = p.parse_args(argv)
    print(json.dumps(measure_vector_add(args.bytes, args.seconds), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
