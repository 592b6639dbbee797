"""A rank (the last, or VICTIM) is SIGKILLed while every rank loops over large allreduces.

usage: dead_peer.py before|during [VICTIM]
The survivors must raise within SMDDP_TIMEOUT with a message naming the dead rank. The
victim reports "fault" {at: wall time} just before it dies, survivors "raised" {at,
message} and then "again" {message} for a later call that must fail at once (report.py),
so bench/fault_detection.py can time how long every rank took to learn of it.
"""
import os
import signal
import sys
import threading
import time

import numpy as np
from report import report

from smdistributed.common import engine


def die():
    report("fault", at=time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def main(mode, victim=None):
    core = engine.init()
    P, me = core.size, core.rank
    x = np.ones(4 << 20, np.float32)
    try:
        # A survivor may still be finishing this one when the victim, done with it, dies: a
        # peer on its host sees the death then (it watches its local peers' pids).
        core.allreduce(x, name="warmup")
        if me == (P - 1 if victim is None else victim):
            if mode == "before":
                die()
            # "during": die while the collective below is in flight.
            threading.Timer(0.3, die).start()
        for i in range(100000):
            core.allreduce(x, name=f"big.{i % 2}")
    except engine.SmddpError as e:
        report("raised", at=time.time(), message=str(e))
        # Later calls fail at once with the same reason instead of hanging.
        try:
            core.allreduce(np.ones(2, np.float32), name="after")
        except engine.SmddpError as e2:
            report("again", message=str(e2))
        sys.exit(0)
    raise AssertionError("the dead peer was never noticed")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
