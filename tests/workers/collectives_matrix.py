"""Every collective x dtype (x op) through the core, checked against numpy on every rank.

Sizes include 0, 1, odd, and larger than the fusion threshold and the shared-memory slot
(the test sets both small), so multi-round and fused paths run too. Each group of checks
reports {"event": "checked", "collective": ..., "ok": ..., "error": ...} (report.py); a
wrong result in one group is reported and the others still run (results are compared after
each collective completes, so the ranks stay in step).
"""
import sys
import traceback

import numpy as np
from reference import DTYPES, OPS, assert_close, make_input, reduce_reference, storage_dtype
from report import report

from smdistributed.common import engine

SIZES = [0, 1, 7, 1001, 70001]


def check_allreduce(core, P, me):
    seed = 0
    for dtype in DTYPES:
        for op in OPS:
            if dtype == "bool" and op == "average":
                x = make_input(dtype, me, 4, 1)
                try:
                    core.allreduce(x, op=op, name="bool-average")
                except engine.SmddpError as e:
                    assert "AVERAGE is not defined for bool" in str(e), e
                else:
                    raise AssertionError("AVERAGE of bool did not raise")
                continue
            for n in SIZES:
                seed += 1
                inputs = [make_input(dtype, r, n, seed, op) for r in range(P)]
                x = inputs[me].copy()
                core.allreduce(x, op=op, dtype=dtype if dtype == "bfloat16" else None)
                assert_close(dtype, x, reduce_reference(dtype, op, inputs), f"allreduce {dtype} {op} n={n}")
                # Out of place leaves the input alone.
                y = inputs[me].copy()
                out = np.empty_like(y)
                core.allreduce(y, op=op, out=out, dtype=dtype if dtype == "bfloat16" else None)
                assert np.array_equal(y, inputs[me]), "out-of-place allreduce modified its input"
                assert_close(dtype, out, reduce_reference(dtype, op, inputs), f"allreduce(out=) {dtype} {op} n={n}")


def check_broadcast_reduce(core, P, me):
    for dtype in DTYPES:
        for n in SIZES:
            for root in range(P):
                inputs = [make_input(dtype, r, n, 100 + root) for r in range(P)]
                x = inputs[me].copy()
                core.broadcast(x, root=root, dtype=dtype if dtype == "bfloat16" else None)
                assert np.array_equal(x, inputs[root]), f"broadcast {dtype} n={n} root={root}"
            for op in ["sum", "max"]:
                root = P - 1
                inputs = [make_input(dtype, r, n, 200) for r in range(P)]
                x = inputs[me].copy()
                out = np.zeros_like(x)
                core.reduce(x, root=root, op=op, out=out, dtype=dtype if dtype == "bfloat16" else None)
                assert np.array_equal(x, inputs[me]), "reduce modified its input"
                if me == root:
                    assert_close(dtype, out, reduce_reference(dtype, op, inputs), f"reduce {dtype} {op} n={n}")


def check_allgather(core, P, me):
    for dtype in DTYPES:
        # Ragged first dimension, including a rank that contributes nothing.
        rows = [(r * 3 + 1) % 4 for r in range(P)]
        inputs = [make_input(dtype, r, rows[r] * 5, 300).reshape(rows[r], 5) for r in range(P)]
        got = core.allgather(inputs[me], dtype=dtype if dtype == "bfloat16" else None)
        assert np.array_equal(got, np.concatenate(inputs)), f"allgather {dtype}"
        # Equal sizes into a caller's buffer.
        inputs = [make_input(dtype, r, 1001, 301) for r in range(P)]
        out = np.empty(1001 * P, dtype=storage_dtype(dtype))
        core.allgather(inputs[me], out=out, dtype=dtype if dtype == "bfloat16" else None)
        assert np.array_equal(out, np.concatenate(inputs)), f"allgather(out=) {dtype}"


def check_reduce_scatter(core, P, me):
    for dtype in DTYPES:
        for op in ["sum", "min"]:
            for counts in ([5] * P, [r * 2 + 1 for r in range(P)], [0] + [3] * (P - 1)):
                n = sum(counts)
                inputs = [make_input(dtype, r, n, 400 + n) for r in range(P)]
                got = core.reduce_scatter(inputs[me].copy(), op=op, counts=counts,
                                          dtype=dtype if dtype == "bfloat16" else None)
                full = reduce_reference(dtype, op, inputs)
                lo = sum(counts[:me])
                assert_close(dtype, got, full[lo:lo + counts[me]], f"reduce_scatter {dtype} {op} {counts}")


def check_alltoall(core, P, me):
    for dtype in DTYPES:
        # splits[s][d]: rows rank s sends to rank d (uneven, some zero).
        splits = [[(s + 2 * d) % 3 for d in range(P)] for s in range(P)]
        inputs = [make_input(dtype, s, sum(splits[s]) * 4, 500).reshape(-1, 4) for s in range(P)]
        got, recv_rows = core.alltoall(inputs[me], splits=splits[me], dtype=dtype if dtype == "bfloat16" else None)
        want = []
        for s in range(P):
            lo = sum(splits[s][:me])
            want.append(inputs[s][lo:lo + splits[s][me]])
        assert recv_rows == [splits[s][me] for s in range(P)], (recv_rows, splits)
        assert np.array_equal(got, np.concatenate(want)), f"alltoall {dtype}"
        # Even split.
        even = make_input(dtype, me, P * 6, 501).reshape(P * 2, 3)
        got, _ = core.alltoall(even, dtype=dtype if dtype == "bfloat16" else None)
        want = np.concatenate([make_input(dtype, s, P * 6, 501).reshape(P * 2, 3)[2 * me:2 * me + 2] for s in range(P)])
        assert np.array_equal(got, want), f"alltoall even {dtype}"


def check_p2p_and_barrier(core, P, me):
    core.barrier()
    # A ring of send/recv with a large message (more than a ring buffer) and a tag.
    n = 300_000
    right, left = (me + 1) % P, (me - 1) % P
    payload = np.arange(n, dtype=np.float64) + me
    send = core.send(payload, right, tag=3, async_op=True)
    got = core.recv(np.empty(n, dtype=np.float64), left, tag=3)
    send.wait()
    assert np.array_equal(got, np.arange(n, dtype=np.float64) + left), "send/recv ring"
    core.barrier()
    # Receives match by tag, not arrival order: receive tag 6 before tag 5 though 5 came first,
    # and post a receive only after its message has arrived (the engine buffers it).
    if me == 0:
        first, second = np.full(7, 5.0), np.full(300_000, 6.0)
        core.send(first, 1, tag=5)
        core.send(second, 1, tag=6)
    elif me == 1:
        got6 = core.recv(np.empty(300_000), 0, tag=6)
        got5 = core.recv(np.empty(7), 0, tag=5)
        assert np.all(got6 == 6.0) and np.all(got5 == 5.0), "tag matching"
    core.barrier()
    # Point-to-point messages interleaved with large collectives in flight: every channel
    # kind has its own rings, so neither stream can corrupt the other.
    x = np.arange(n, dtype=np.float32) * (me + 1)
    for i in range(10):
        token = np.full(1, i, np.float32)
        if me == 0:
            w = core.allgather(x, name=f"p2p-mix.{i}", async_op=True)
            for r in range(1, P):
                core.send(token, r, tag=i)
        else:
            core.recv(token, 0, tag=i)
            assert token[0] == i
            w = core.allgather(x, name=f"p2p-mix.{i}", async_op=True)
        got = w.wait()
        assert np.array_equal(got, np.concatenate([np.arange(n, dtype=np.float32) * (r + 1) for r in range(P)]))


def check_async(core, P, me):
    works = [core.allreduce(np.full(10, me + i, np.float32), name=f"async.{i}", async_op=True) for i in range(20)]
    for i, w in enumerate(works):
        w.wait()
        assert w.is_completed()
    x = np.full(3, float(me), np.float32)
    w = core.allreduce(x, name="polled", async_op=True)
    while not w.is_completed():
        pass
    w.wait()
    assert np.allclose(x, sum(range(P))), x


CHECKS = {
    "allreduce": check_allreduce,
    "broadcast_reduce": check_broadcast_reduce,
    "allgather": check_allgather,
    "reduce_scatter": check_reduce_scatter,
    "alltoall": check_alltoall,
    "p2p_and_barrier": check_p2p_and_barrier,
    "async": check_async,
}


def main():
    core = engine.init()
    P, me = core.size, core.rank
    failed = 0
    for name, check in CHECKS.items():
        try:
            check(core, P, me)
            report("checked", collective=name, ok=True, hosts=core.num_hosts)
        except AssertionError:
            failed += 1
            report("checked", collective=name, ok=False, hosts=core.num_hosts, error=traceback.format_exc())
    engine.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
