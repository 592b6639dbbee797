"""A receive whose sender never posts fails alone after the timeout; the engine then keeps
working (collectives and point-to-point)."""
import sys
import time

import numpy as np
from report import report

from smdistributed.common import engine


def main():
    core = engine.init()
    if core.rank == 1:
        t0 = time.monotonic()
        try:
            core.recv(np.empty(4, np.float32), 0, tag=99)
        except engine.SmddpError as e:
            report("raised", after_s=time.monotonic() - t0, message=str(e))
        else:
            raise AssertionError("a receive without a sender completed")
    else:
        time.sleep(5)  # meet rank 1 after its receive has failed (well inside the stall timeout)
    core.barrier(name="after-orphan")
    x = np.ones(100, np.float32)
    core.allreduce(x, name="after-orphan.allreduce")
    assert np.all(x == core.size)
    if core.rank == 0:
        core.send(np.full(3, 7.0, np.float32), 1, tag=5)
    elif core.rank == 1:
        got = core.recv(np.empty(3, np.float32), 0, tag=5)
        assert np.all(got == 7.0)
    # Rank 0's goodbye ends all communication (docs/core.md): without this barrier rank 1's
    # receive could be submitted after it, and be refused although the message had arrived.
    core.barrier(name="before-exit")
    report("usable")
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
