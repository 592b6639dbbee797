"""A rank that stops (SIGSTOP: alive, sockets open, silent) while the others run collectives.

usage: stalled_peer.py VICTIM [cached]
Every other rank's collective must raise within the timeout (plus a little), naming the
victim. Survivors report "raised" {at: wall time, after_s, message}; the victim reports
"fault" {at} as it stops (report.py; bench/fault_detection.py times them). With "cached" the
steps reuse two names, so the collective the victim misses is a cache hit (a hit cycle
waits on it) rather than an announcement to rank 0.
"""
import os
import signal
import sys
import time

import numpy as np
from report import report

from smdistributed.common import engine


def main(victim, cached):
    core = engine.init()
    for step in range(1000):
        if step == 3 and core.rank == victim:
            report("fault", at=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
        x = np.ones(100_000, np.float32)
        t0 = time.monotonic()
        try:
            core.allreduce(x, name=f"step.{step % 2 if cached else step}")
        except engine.SmddpError as e:
            report("raised", at=time.time(), after_s=time.monotonic() - t0, message=str(e))
            os._exit(0)
    raise AssertionError("the collectives went on past the stall")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:] == ["cached"])
