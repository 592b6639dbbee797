"""A rank that stops (SIGSTOP: alive, sockets open, silent) while the others run collectives.

usage: stalled_peer.py VICTIM
Every other rank's collective must raise within the timeout (plus a little), naming the
victim. Prints "RAISED after <s> s: <message>" (and RAISED_AT=<wall time>) on survivors;
the victim prints FAULT_AT=<wall time> as it stops (bench/fault_detection.py).
"""
import os
import signal
import sys
import time

import numpy as np

from smdistributed.common import engine


def main(victim):
    core = engine.init()
    for step in range(1000):
        if step == 3 and core.rank == victim:
            print(f"FAULT_AT={time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        x = np.ones(100_000, np.float32)
        t0 = time.monotonic()
        try:
            core.allreduce(x, name=f"step.{step}")
        except engine.SmddpError as e:
            print(f"RAISED_AT={time.time():.6f}", flush=True)
            print(f"RAISED after {time.monotonic() - t0:.1f} s: {e}", flush=True)
            os._exit(0)
    raise AssertionError("the collectives went on past the stall")


if __name__ == "__main__":
    main(int(sys.argv[1]))
