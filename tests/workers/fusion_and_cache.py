"""50 named tensors submitted in a different shuffled order on each rank, for several steps.

Mode "batch" submits each step's tensors as one batch (core.batch()), so every rank
announces them in one message and they become ready together: fusion and the cache's
effect on negotiation are then deterministic and the counters (reported per step as a
"counters" event, report.py) can be checked exactly. Mode "stream" submits them one by one: only correctness is checked.
Mode "evict" (run with a small SMDDP_CACHE_CAPACITY) streams a working set of names that
slides every few steps, so the cache both hits and evicts while announcements by id are
still in flight: every element is checked.
"""
import contextlib
import sys

import numpy as np
from report import report

from smdistributed.common import engine

N_TENSORS = 50
STEPS = 3


def sliding_working_set(core):
    P, me = core.size, core.rank
    rng = np.random.default_rng(99 + me)
    before = core.counters()
    for step in range(40):
        names = [f"slide.{(step // 4) * 3 + i}" for i in range(5)]  # 5 names, 3 new every 4 steps
        arrays, works = {}, []
        for j in rng.permutation(len(names)):
            n = int(names[j].split(".")[1])
            arrays[n] = np.full(n % 7 + 3, float(me * 10 + n + step), dtype=np.float32)
            works.append(core.allreduce(arrays[n], name=names[j], async_op=True))
        for w in works:
            w.wait()
        for n, a in arrays.items():
            assert np.all(a == sum(r * 10 + n + step for r in range(P))), (step, n, a)
    after = core.counters()
    report("counters", steps=[{k: after[k] - before[k] for k in after}])
    engine.shutdown()


def main(mode):
    core = engine.init()
    if mode == "evict":
        return sliding_working_set(core)
    P, me = core.size, core.rank
    rng = np.random.default_rng(1234 + me)  # each rank its own order
    sizes = [(i * 37) % 500 + 1 for i in range(N_TENSORS)]
    per_step = []
    for step in range(STEPS):
        order = rng.permutation(N_TENSORS)
        before = core.counters()
        arrays = {}
        works = []
        with core.batch() if mode == "batch" else contextlib.nullcontext():
            for i in order:
                arrays[i] = np.full(sizes[i], float(me + i + step), dtype=np.float32)
                works.append(core.allreduce(arrays[i], name=f"grad.{i}", async_op=True))
        for w in works:
            w.wait()
        for i in range(N_TENSORS):
            want = sum(r + i + step for r in range(P))
            assert np.all(arrays[i] == want), (i, arrays[i][:3], want)
        after = core.counters()
        per_step.append({k: after[k] - before[k] for k in after})
    report("counters", steps=per_step)
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
