"""A rank that stops (SIGSTOP: alive, sockets open, silent) while the others run collectives.

usage: stalled_peer.py VICTIM [cached | p2p]
Every other rank's collective must raise within the timeout (plus a little), naming the
victim. With "p2p" the others wait on point-to-point receives from the victim instead (a
pipeline stage's wait): its engine no longer answers their pings. Survivors report "raised"
{at: wall time, after_s, message}; the victim reports "fault" {at} as it stops (report.py;
bench/fault_detection.py times them). With "cached" the steps reuse two names, so the
collective the victim misses is a cache hit (a hit cycle waits on it) rather than an
announcement to rank 0.
"""
import os
import signal
import sys
import time

import numpy as np
from report import report

from smdistributed.common import engine


def step_p2p(core, victim, step):
    """The victim sends each other rank one message a step; they receive it."""
    x = np.full(1000, float(step), np.float32)
    if core.rank == victim:
        works = [core.send(x, r, tag=step, async_op=True) for r in range(core.size) if r != victim]
        for w in works:
            w.wait()
    else:
        core.recv(x, victim, tag=step)
        assert np.all(x == step)


def main(victim, mode):
    core = engine.init()
    # Every rank finishes its start-up before the victim may stop: rank 0 serves the bootstrap
    # store, and point-to-point sends complete without their receiver, so in "p2p" mode a
    # victim could otherwise stop while a peer still reads the store (that peer would then fail
    # its start-up, not the receive this test is about).
    core.allreduce(np.ones(1, np.float32), name="started")
    for step in range(1000):
        if step == 3 and core.rank == victim:
            report("fault", at=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
        x = np.ones(100_000, np.float32)
        t0 = time.monotonic()
        try:
            if mode == "p2p":
                step_p2p(core, victim, step)
            else:
                core.allreduce(x, name=f"step.{step % 2 if mode == 'cached' else step}")
        except engine.SmddpError as e:
            report("raised", at=time.time(), after_s=time.monotonic() - t0, message=str(e))
            os._exit(0)
    raise AssertionError("the collectives went on past the stall")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "announced")
