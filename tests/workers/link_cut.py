"""Collectives in a loop until the network between the hosts is cut (the test brings the
link down): every rank must raise within the timeout, naming what failed.

Prints READY after the first collectives, then "RAISED after <s> s: <message>".
"""
import sys
import time

import numpy as np

from smdistributed.common import engine


def main():
    core = engine.init()
    x = np.ones(262_144, np.float32)
    for step in range(100_000):
        t0 = time.monotonic()
        try:
            core.allreduce(x, name=f"loop.{step % 4}")
        except engine.SmddpError as e:
            print(f"RAISED after {time.monotonic() - t0:.1f} s: {e}", flush=True)
            return
        if step == 20:
            print("READY", flush=True)
        x[:] = 1.0
    raise AssertionError("the collectives never failed")


if __name__ == "__main__":
    sys.exit(main())
