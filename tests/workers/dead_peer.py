"""The last rank is SIGKILLed while every rank loops over large allreduces.

The survivors must raise within SMDDP_TIMEOUT with a message naming the dead rank.
"""
import os
import signal
import sys
import threading

import numpy as np

from smdistributed.common import engine


def main(mode):
    core = engine.init()
    P, me = core.size, core.rank
    x = np.ones(4 << 20, np.float32)
    core.allreduce(x, name="warmup")
    if me == P - 1:
        if mode == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        # "during": die while the collective below is in flight.
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        for i in range(100000):
            core.allreduce(x, name=f"big.{i % 2}")
    except engine.SmddpError as e:
        print("RAISED: " + str(e), flush=True)
        # Later calls fail at once with the same reason instead of hanging.
        try:
            core.allreduce(np.ones(2, np.float32), name="after")
        except engine.SmddpError as e2:
            print("AGAIN: " + str(e2), flush=True)
        sys.exit(0)
    raise AssertionError("the dead peer was never noticed")


if __name__ == "__main__":
    main(sys.argv[1])
