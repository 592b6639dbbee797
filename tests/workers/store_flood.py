"""A job that starts while someone floods rank 0's rendezvous store and the ranks' bootstrap
listeners (see test_store_and_bootstrap_survive_a_flood): it must start, compute, and rank 0
reports how many connections its store turned away.

usage: store_flood.py EXPECTED_REFUSALS
"""
import sys
import time

import numpy as np

from smdistributed.common import engine
from smdistributed.common.discovery import discover


def main(expected):
    if discover().rank != 0:
        time.sleep(1.5)  # rank 0's store is up (and flooded) before the others bootstrap
    core = engine.init()
    x = np.full(1000, core.rank + 1.0, np.float32)
    core.allreduce(x, name="after-flood")
    assert np.all(x == core.size * (core.size + 1) / 2)
    if core.rank == 0:
        deadline = time.monotonic() + 10
        while core.store_refused_connections() < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"REFUSED={core.store_refused_connections()}", flush=True)
    core.barrier(name="done")
    print(f"rank {core.rank}: flood survived", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
