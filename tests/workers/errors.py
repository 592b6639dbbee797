"""Ranks that disagree, or misuse the API; every rank must raise a clear error, none hang.

Usage: errors.py CASE. Reports (report.py) a "raised" event with the message of each
expected error, and "usable" when the engine still works afterwards. CASE "warm_<case>" first runs the same collective
correctly twice on every rank, so it is cached: the disagreement then meets a cache hit
(agreed in hit cycles) on the ranks that did not change it.
"""
import os
import sys
import time

import numpy as np
from report import report

from smdistributed.common import engine


def expect_error(fn):
    try:
        fn()
    except engine.SmddpError as e:
        report("raised", message=str(e))
        return
    raise AssertionError("expected an error")


def warm_up(core, case):
    for _ in range(2):
        if case == "broadcast_root":
            core.broadcast(np.zeros(4, np.float32), root=0, name="w.root")
        elif case in ("shape", "dtype", "op"):
            core.allreduce(np.zeros(4, np.float32), name="w." + case)
        elif case == "missing":
            core.allreduce(np.ones(4, np.float32), name="lonely")


def main(case):
    core = engine.init()
    P, me = core.size, core.rank
    if case.startswith("warm_"):
        case = case[len("warm_"):]
        warm_up(core, "broadcast_root" if case == "root" else case)
    if case == "shape":
        expect_error(lambda: core.allreduce(np.zeros(4 + me, np.float32), name="w.shape"))
    elif case == "dtype":
        expect_error(lambda: core.allreduce(np.zeros(4, np.float32 if me == 0 else np.float64), name="w.dtype"))
    elif case == "op":
        expect_error(lambda: core.allreduce(np.zeros(4, np.float32), op="sum" if me == 0 else "max", name="w.op"))
    elif case == "root":
        expect_error(lambda: core.broadcast(np.zeros(4, np.float32), root=me % 2, name="w.root"))
    elif case == "duplicate":
        # Rank 1 submits "dup" only after rank 0's second submission, so rank 0's first one
        # is certainly still in flight then.
        sync = os.environ["SYNC_DIR"]
        if me == 0:
            w = core.allreduce(np.ones(4, np.float32), name="dup", async_op=True)
            expect_error(lambda: core.allreduce(np.ones(4, np.float32), name="dup"))
            open(os.path.join(sync, "second-submitted"), "w").close()
        else:
            while not os.path.exists(os.path.join(sync, "second-submitted")):
                time.sleep(0.01)
            w = core.allreduce(np.ones(4, np.float32), name="dup", async_op=True)
        w.wait()
        if me:
            report("raised", message="(rank %d submitted once)" % me)
    elif case == "missing":
        # The last rank never submits "lonely": the others fail after SMDDP_TIMEOUT, naming it.
        # It waits (outside the engine) until they have failed, then everyone goes on.
        sync = os.environ["SYNC_DIR"]
        if me != P - 1:
            expect_error(lambda: core.allreduce(np.ones(4, np.float32), name="lonely"))
            open(os.path.join(sync, f"failed.{me}"), "w").close()
        else:
            while not all(os.path.exists(os.path.join(sync, f"failed.{r}")) for r in range(P - 1)):
                time.sleep(0.02)
            report("raised", message="(the missing rank)")
    elif case == "bad_root":
        try:
            core.broadcast(np.zeros(2, np.float32), root=P + 3)
        except engine.SmddpError as e:
            report("raised", message=str(e))
    else:
        raise SystemExit("unknown case " + case)
    # After a per-tensor error the engine keeps working.
    x = np.full(3, float(me), np.float32)
    core.allreduce(x, name="after")
    assert np.allclose(x, sum(range(P))), x
    report("usable")
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
