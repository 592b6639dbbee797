"""Bad arguments through the numpy API: a clear error naming what is wrong, never a crash or
wrong data, and the engine keeps working for the next call.

Each case either fails locally (the same bad call on every rank: each rank raises at
submission, nothing is queued) or through negotiation (one rank's output cannot hold what the
others send: every rank raises, naming that rank). After every case a correct allreduce
checks that the engine is healthy. Each case reports {"event": "case", "name", "ok", "error"}
(report.py); a failing case is reported and the next one still runs.
"""
import gc
import sys
import threading
import traceback

import numpy as np
from report import report

from smdistributed import _core
from smdistributed.common import engine

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def expect(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in: {msg}"
        return msg
    raise AssertionError(f"expected {exc.__name__} containing {needles}")


def healthy(core, tag):
    x = np.full(1000, core.rank + 1, np.float32)
    core.allreduce(x, name=f"healthy.{tag}")
    assert np.all(x == core.size * (core.size + 1) / 2), x[:4]


@case
def broadcast_into_smaller_output(core):
    x = np.ones(100, np.float32)
    expect(engine.SmddpError, lambda: core.broadcast(x, root=0, out=np.empty(10, np.float32), name="b.small"),
           "output buffer holds 40 bytes but the input has 400")


@case
def reduce_into_smaller_output(core):
    x = np.ones(100, np.float32)
    expect(engine.SmddpError, lambda: core.reduce(x, root=core.rank, out=np.empty(99, np.float32), name="r.small"),
           "root's output buffer holds 396 bytes")


@case
def read_only_arrays(core):
    ro = np.ones(50, np.float32)
    ro.flags.writeable = False
    expect(ValueError, lambda: core.allreduce(ro, name="ro.inplace"), "read-only")
    expect(ValueError, lambda: core.broadcast(ro, name="ro.bcast"), "read-only")
    expect(ValueError, lambda: core.recv(ro, (core.rank + 1) % core.size), "read-only")
    out = np.empty(50, np.float32)
    core.allreduce(ro, out=out, name="ro.outofplace")  # reading a read-only input is fine
    assert np.all(out == core.size) and np.all(ro == 1)


@case
def raw_submissions_with_wrong_sizes(core):
    e = core._engine
    x = np.zeros(12, np.float32)
    P = core.size

    def submit(**kw):
        args = dict(op=_core.OpType.ALLREDUCE, name="raw", in_ptr=x.ctypes.data, out_ptr=x.ctypes.data, count=12,
                    out_capacity=x.nbytes, dtype=_core.DType.float32, shape=[12])
        args.update(kw)
        return e.submit(**args)

    expect(engine.SmddpError, lambda: submit(shape=[3, 5]), "shape [3, 5] does not hold the 12 elements")
    expect(engine.SmddpError, lambda: submit(out_capacity=8), "output buffer holds 8 bytes")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.REDUCE_SCATTER, splits=[13] + [0] * (P - 1)),
           "add up to 13 elements, the input has 12")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.REDUCE_SCATTER, splits=[-1, 13] + [0] * (P - 2)),
           "negative entry")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.REDUCE_SCATTER, splits=[12]), "blocks for")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.ALLTOALL, per_rank=[1 << 40] + [0] * (P - 1)),
           "add up to")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.ALLTOALL, per_rank=[-5, 17] + [0] * (P - 2)),
           "negative entry")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.ALLTOALL, per_rank=[12]), "entries for")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.ALLGATHER, per_rank=[-3]), "negative row count")
    expect(engine.SmddpError, lambda: submit(op=_core.OpType.ALLGATHER, per_rank=[5]), "sends 5 rows")
    expect(engine.SmddpError, lambda: submit(count=1 << 62, shape=[]), "too large")


@case
def one_rank_output_too_small(core):
    """Rank 1's allgather output cannot hold the result: every rank fails, naming rank 1."""
    x = np.ones(10, np.float32)
    out = np.empty(10 * core.size - (1 if core.rank == 1 else 0), np.float32)
    expect(engine.SmddpError, lambda: core.allgather(x, out=out, name="ag.small"),
           "rank 1's output buffer holds")


@case
def alltoall_output_too_small_on_one_rank(core):
    x = np.ones((core.size * 2, 3), np.float32)
    out = np.empty((core.size * 2 - (1 if core.rank == core.size - 1 else 0), 3), np.float32)
    expect(engine.SmddpError, lambda: core.alltoall(x, out=out, name="a2a.small"),
           f"rank {core.size - 1}'s output buffer holds")


@case
def dropped_async_handles(core):
    """Handles dropped before completion (and their arrays): the engine finishes with buffers
    that are still alive, and the next calls are correct."""
    for i in range(20):
        core.allreduce(np.full(300_000, float(i), np.float32), name=f"dropped.{i}", async_op=True)
        gc.collect()
    x = np.full(300_000, 1.0, np.float32)
    core.allreduce(x, name="after-dropped")
    assert np.all(x == core.size)
    healthy(core, "dropped")
    core._orphans.sweep()
    assert len(core._orphans) == 0, len(core._orphans)


@case
def unnamed_from_two_threads(core):
    errors = []

    def other():
        try:
            core.allreduce(np.ones(3, np.float32))
        except RuntimeError as e:
            errors.append(str(e))
        # Named calls from threads are fine.
        y = np.ones(3, np.float32)
        core.allreduce(y, name="from-thread")
        assert np.all(y == core.size)

    core.allreduce(np.ones(3, np.float32))  # this thread issues the unnamed calls
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "second thread" in errors[0], errors


def main():
    core = engine.init()
    failed = 0
    for fn in CASES:
        try:
            fn(core)
            report("case", name=fn.__name__, ok=True)
        except AssertionError:
            failed += 1
            report("case", name=fn.__name__, ok=False, error=traceback.format_exc())
        healthy(core, fn.__name__)
    engine.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
