"""Runs allreduces (checked) for SECONDS while the test attacks the job from outside, then
rank 0 reports how many connections its store refused.

usage: healthy_for.py SECONDS
"""
import sys
import time

import numpy as np

from smdistributed.common import engine


def main(seconds):
    core = engine.init()
    if core.rank == 0:
        print("STORE UP", flush=True)
    deadline = time.monotonic() + seconds
    step = 0
    while True:
        go = np.array([time.monotonic() < deadline], np.uint8)
        core.broadcast(go, root=0, name=f"go.{step}")
        if not go[0]:
            break
        x = np.full(4096, core.rank + 1.0, np.float32)
        core.allreduce(x, name=f"health.{step % 8}")
        assert np.all(x == core.size * (core.size + 1) / 2)
        step += 1
        time.sleep(0.02)
    if core.rank == 0:
        print(f"REFUSED={core.store_refused_connections()} STEPS={step}", flush=True)
    print(f"BOOTSTRAP_REFUSED={core.bootstrap_refused_connections()}", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main(float(sys.argv[1]))
