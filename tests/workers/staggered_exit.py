"""Ranks that finish at different times, then (optionally) start a new engine and finish again:
no rank reports another as dead, and re-initialisation works.

usage: staggered_exit.py ROUNDS
"""
import sys
import time

import numpy as np

from smdistributed.common import engine


def main(rounds):
    for round_ in range(rounds):
        core = engine.init()
        x = np.full(10, core.rank, np.float32)
        core.allreduce(x, name=f"round.{round_}")
        assert np.all(x == sum(range(core.size))), x
        # Ranks shut down at different times, rank 0 (which serves the store) last or first.
        time.sleep(0.25 * (core.rank if round_ % 2 else core.size - 1 - core.rank))
        engine.shutdown()
    print(f"rank {core.rank}: staggered exit ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
