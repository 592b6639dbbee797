"""Every torch.distributed collective x dtype on the smddp backend, against a single-process result.

Each collective also runs with async_op=True completed through Work.wait(), only through
get_future() (as DDP's communication hooks do), and by polling is_completed(); non-contiguous
tensors, a tensor on another device and unsupported dtypes. Reports one "checked" event per
family of collectives (report.py), which the tests turn into one case each.
"""
import datetime
import sys
import time
import traceback

import torch
import torch.distributed as dist
from report import report
from torch_common import (DTYPES, OPS, assert_same, expect_raises, make_input, native_backend, reduce_reference,
                          use_test_device)

ASYNC_MODES = ["wait", "future", "poll"]
SHAPES = [(0,), (1,), (7,), (1001,), (3, 5)]
_seed = [0]


def seed():
    _seed[0] += 1
    return _seed[0]


def ops_for(dtype):
    return [op for op in OPS if not (dtype == torch.bool and op == "AVG")]


def host_sync():
    """On a GPU, wait() and a future's completion order the caller's stream after the collective
    and return at once (as with torch's NCCL backend); the host sees the work completed only
    once that stream has run."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.current_stream().synchronize()


def complete(work, mode):
    """Completes an operation the way `mode` says and checks torch's Work interface on the way."""
    if mode == "sync":
        assert work is None, "a synchronous call returned a Work"
        return
    assert work is not None, "async_op=True returned no Work"
    if mode == "wait":
        assert work.wait() is True
        host_sync()
        assert work.is_completed(), "is_completed() is False after wait()"
        assert work.is_success()
        fut = work.get_future()  # after completion the future is already (or immediately) done
        fut.wait()
        assert fut.done()
        assert fut.then(lambda f: "chained").wait() == "chained"
    elif mode == "poll":
        # Polled until done, then read without wait(): the results must be in place.
        while not work.is_completed():
            time.sleep(0.001)
        assert work.is_success()
    else:
        # Only through the future: the results must be in place when it completes, without wait().
        fut = work.get_future()
        chained = fut.then(lambda f: ("chained", f.value()))
        tag, _ = chained.wait()
        assert tag == "chained"
        assert fut.done()
        host_sync()
        assert work.is_completed(), "is_completed() is False after the future completed"


def check_all_reduce(P, me, dtype, op, shape, mode):
    s = seed()
    inputs = [make_input(dtype, r, shape, s, op) for r in range(P)]
    x = inputs[me].clone()
    work = dist.all_reduce(x, op=OPS[op], async_op=mode != "sync")
    if mode == "future":
        fut = work.get_future()
        value = fut.wait()
        assert value[0].data_ptr() == x.data_ptr(), "the future's value is not the reduced tensor"
    complete(work, mode)
    assert_same(x, reduce_reference(dtype, op, inputs), f"all_reduce {dtype} {op} {shape} {mode}")


def check_broadcast(P, me, dtype, root, shape, mode):
    s = seed()
    inputs = [make_input(dtype, r, shape, s) for r in range(P)]
    x = inputs[me].clone()
    complete(dist.broadcast(x, src=root, async_op=mode != "sync"), mode)
    assert_same(x, inputs[root], f"broadcast {dtype} root={root} {shape} {mode}")


def check_reduce(P, me, dtype, op, root, shape, mode):
    s = seed()
    inputs = [make_input(dtype, r, shape, s, op) for r in range(P)]
    x = inputs[me].clone()
    complete(dist.reduce(x, dst=root, op=OPS[op], async_op=mode != "sync"), mode)
    if me == root:
        assert_same(x, reduce_reference(dtype, op, inputs), f"reduce {dtype} {op} dst={root} {shape} {mode}")


def check_all_gather(P, me, dtype, shape, mode):
    s = seed()
    inputs = [make_input(dtype, r, shape, s) for r in range(P)]
    outs = [torch.full(shape, 1, dtype=dtype) for _ in range(P)]
    complete(dist.all_gather(outs, inputs[me].clone(), async_op=mode != "sync"), mode)
    for r in range(P):
        assert_same(outs[r], inputs[r], f"all_gather {dtype} {shape} {mode} part {r}")


def check_all_gather_into_tensor(P, me, dtype, shape, stacked, mode):
    s = seed()
    inputs = [make_input(dtype, r, shape, s) for r in range(P)]
    want = torch.stack(inputs) if stacked else torch.cat(inputs)
    out = torch.zeros_like(want)
    complete(dist.all_gather_into_tensor(out, inputs[me].clone(), async_op=mode != "sync"), mode)
    assert_same(out, want, f"all_gather_into_tensor {dtype} {shape} stacked={stacked} {mode}")


def check_reduce_scatter_tensor(P, me, dtype, op, n, mode):
    s = seed()
    inputs = [make_input(dtype, r, (P * n,), s, op) for r in range(P)]
    out = torch.zeros(n, dtype=dtype)
    x = inputs[me].clone()
    complete(dist.reduce_scatter_tensor(out, x, op=OPS[op], async_op=mode != "sync"), mode)
    want = reduce_reference(dtype, op, inputs)[me * n:(me + 1) * n]
    assert_same(out, want, f"reduce_scatter_tensor {dtype} {op} n={n} {mode}")
    assert_same(x, inputs[me], "reduce_scatter_tensor modified its input")


def check_reduce_scatter_list(P, me, dtype, op, shape, mode):
    s = seed()
    # inputs[r][d]: what rank r contributes to rank d's result.
    inputs = [[make_input(dtype, r * P + d, shape, s, op) for d in range(P)] for r in range(P)]
    out = torch.zeros(shape, dtype=dtype)
    complete(dist.reduce_scatter(out, [t.clone() for t in inputs[me]], op=OPS[op], async_op=mode != "sync"), mode)
    want = reduce_reference(dtype, op, [inputs[r][me] for r in range(P)])
    assert_same(out, want, f"reduce_scatter (list) {dtype} {op} {shape} {mode}")


def a2a_rows(src, dst):
    """Rows rank src sends rank dst in the uneven all_to_all tests (0 included)."""
    return (src + 2 * dst) % 3


def check_all_to_all_single(P, me, dtype, uneven, mode):
    s = seed()
    cols = 3
    if uneven:
        send = [[a2a_rows(r, d) for d in range(P)] for r in range(P)]
    else:
        send = [[2] * P for _ in range(P)]
    inputs = [make_input(dtype, r, (sum(send[r]), cols), s) for r in range(P)]

    def part(r, d):  # rows of rank r's input destined to rank d
        start = sum(send[r][:d])
        return inputs[r][start:start + send[r][d]]

    want = torch.cat([part(r, me) for r in range(P)])
    out = torch.zeros_like(want)
    if uneven:
        work = dist.all_to_all_single(out, inputs[me].clone(), output_split_sizes=[send[r][me] for r in range(P)],
                                      input_split_sizes=send[me], async_op=mode != "sync")
    else:
        work = dist.all_to_all_single(out, inputs[me].clone(), async_op=mode != "sync")
    complete(work, mode)
    assert_same(out, want, f"all_to_all_single {dtype} uneven={uneven} {mode}")


def check_all_to_all_list(P, me, dtype, mode):
    s = seed()
    inputs = [[make_input(dtype, r * P + d, (a2a_rows(r, d) + 1, 2), s) for d in range(P)] for r in range(P)]
    outs = [torch.zeros_like(inputs[r][me]) for r in range(P)]
    complete(dist.all_to_all(outs, [t.clone() for t in inputs[me]], async_op=mode != "sync"), mode)
    for r in range(P):
        assert_same(outs[r], inputs[r][me], f"all_to_all (list) {dtype} {mode} from {r}")


def check_gather(P, me, dtype, root, mode):
    s = seed()
    inputs = [make_input(dtype, r, (2, 3), s) for r in range(P)]
    outs = [torch.zeros(2, 3, dtype=dtype) for _ in range(P)] if me == root else None
    complete(dist.gather(inputs[me].clone(), gather_list=outs, dst=root, async_op=mode != "sync"), mode)
    if me == root:
        for r in range(P):
            assert_same(outs[r], inputs[r], f"gather {dtype} dst={root} {mode} part {r}")


def check_scatter(P, me, dtype, root, mode):
    s = seed()
    parts = [make_input(dtype, 100 + d, (3, 2), s) for d in range(P)]
    out = torch.zeros(3, 2, dtype=dtype)
    complete(dist.scatter(out, scatter_list=[p.clone() for p in parts] if me == root else None, src=root,
                          async_op=mode != "sync"), mode)
    assert_same(out, parts[me], f"scatter {dtype} src={root} {mode}")


def check_send_recv(P, me, dtype, blocking):
    """A ring: every rank sends to the next and receives from the previous, two messages each."""
    s = seed()
    nxt, prv = (me + 1) % P, (me - 1) % P
    msgs = {r: [make_input(dtype, r * 10 + k, (5 + k,), s) for k in range(2)] for r in range(P)}
    got = [torch.zeros(5 + k, dtype=dtype) for k in range(2)]
    if blocking:
        # Even ranks send first, odd ranks receive first: correct even if sends are synchronous.
        for k in range(2):
            if me % 2 == 0:
                dist.send(msgs[me][k].clone(), dst=nxt, tag=k)
                dist.recv(got[k], src=prv, tag=k)
            else:
                dist.recv(got[k], src=prv, tag=k)
                dist.send(msgs[me][k].clone(), dst=nxt, tag=k)
    else:
        # Receives posted before the sends. Messages from one peer match receives in the order
        # posted (as with NCCL), so the tags come in the same order on both sides.
        recvs = [dist.irecv(got[k], src=prv, tag=k) for k in (0, 1)]
        sends = [dist.isend(msgs[me][k].clone(), dst=nxt, tag=k) for k in (0, 1)]
        for i, w in enumerate(sends + recvs):
            complete(w, ASYNC_MODES[i % len(ASYNC_MODES)])
    for k in range(2):
        assert_same(got[k], msgs[prv][k], f"{'send/recv' if blocking else 'isend/irecv'} {dtype} tag {k}")


def check_batch_p2p(P, me):
    nxt, prv = (me + 1) % P, (me - 1) % P
    out = torch.full((4,), float(me))
    got = torch.zeros(4)
    ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, got, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, torch.full((4,), float(prv))), got


def check_barrier(P, me):
    dist.barrier()
    complete(dist.barrier(async_op=True), "wait")
    complete(dist.barrier(async_op=True), "future")
    complete(dist.barrier(async_op=True), "poll")


def check_non_contiguous(P, me):
    # A transposed view: the results land in the caller's (strided) storage.
    s = seed()
    bases = [make_input(torch.float32, r, (4, 6), s) for r in range(P)]
    base = bases[me].clone()
    view = base.t()
    assert not view.is_contiguous()
    dist.all_reduce(view)
    assert_same(base, reduce_reference(torch.float32, "SUM", bases), "all_reduce of a transposed view")
    # Every other column: the rest of the storage is left alone.
    base = bases[me].clone()
    view = base[:, ::2]
    work = dist.all_reduce(view, op=dist.ReduceOp.MAX, async_op=True)
    complete(work, "future")
    want = bases[me].clone()
    want[:, ::2] = reduce_reference(torch.float32, "MAX", [b[:, ::2] for b in bases])
    assert_same(base, want, "all_reduce of a strided slice")
    for root in range(P):
        base = bases[me].clone()
        dist.broadcast(base.t(), src=root)
        assert_same(base, bases[root], f"broadcast of a transposed view root={root}")
        base = bases[me].clone()
        complete(dist.broadcast(base[1:3, ::3], src=root, async_op=True), "wait")
        want = bases[me].clone()
        want[1:3, ::3] = bases[root][1:3, ::3]
        assert_same(base, want, f"broadcast of a strided slice root={root}")
    # Polled to completion, the strided result is already in place.
    base = bases[me].clone()
    complete(dist.all_reduce(base.t(), async_op=True), "poll")
    assert_same(base, reduce_reference(torch.float32, "SUM", bases), "polled all_reduce of a transposed view")
    # The copy back into a strided tensor happens once: asking for the future after wait()
    # must not overwrite what the caller wrote since.
    base = bases[me].clone()
    work = dist.all_reduce(base.t(), async_op=True)
    work.wait()
    base.fill_(-1)
    work.get_future().wait()
    assert torch.equal(base, torch.full_like(base, -1)), "get_future() after wait() rewrote the tensor"
    outs = [torch.zeros(3) for _ in range(P)]
    work = dist.all_gather(outs, torch.full((3,), float(me)), async_op=True)
    work.wait()
    outs[0].fill_(-1)
    work.get_future().then(lambda f: None).wait()
    assert torch.equal(outs[0], torch.full((3,), -1.0)), "get_future() after wait() rewrote all_gather's output"
    # A received message lands in a non-contiguous view too.
    base = torch.zeros(3, 4)
    if me == 0:
        dist.send(torch.arange(12.0).reshape(4, 3), dst=P - 1)
    elif me == P - 1:
        dist.recv(base.t(), src=0)
        assert_same(base.t(), torch.arange(12.0).reshape(4, 3), "recv into a transposed view")


def scribble():
    """Allocates and fills tensors of many sizes, reusing whatever memory was just freed (on a
    GPU, the caching allocator hands it out again unless the collective's stream holds it)."""
    return [torch.full((n,), 99.0) for n in (3, 5, 6, 7, 9, 12, 15, 18, 256, 300_000) for _ in range(4)]


def check_inputs_outlive_async_calls(P, me):
    """A temporary input handed to an async collective must stay valid until it completes.

    Rank 0 submits, drops its input and overwrites freed memory, and only then lets the other
    ranks submit (told through the c10d store, outside the group), so the collective cannot
    have read rank 0's input before it was dropped.
    """
    store = dist.distributed_c10d._get_default_store()
    n = 300_000  # large enough that freeing it may return it to the system
    inputs = [torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(P)]
    cases = {
        "all_gather": lambda x: ([torch.zeros(n) for _ in range(P)],
                                 lambda outs, x=x: dist.all_gather(outs, x, async_op=True)),
        "all_gather_into_tensor": lambda x: (torch.zeros(P * n),
                                             lambda out, x=x: dist.all_gather_into_tensor(out, x, async_op=True)),
        "all_to_all_single": lambda x: (torch.zeros(n), lambda out, x=x: dist.all_to_all_single(out, x, async_op=True)),
        "all_to_all": lambda x: ([torch.zeros(n // P) for _ in range(P)],
                                 lambda outs, x=x: dist.all_to_all(outs, list(x.chunk(P)), async_op=True)),
        "gather": lambda x: ([torch.zeros(n) for _ in range(P)] if me == 0 else None,
                             lambda outs, x=x: dist.gather(x, gather_list=outs, dst=0, async_op=True)),
        "reduce_scatter_tensor": lambda x: (torch.zeros(n // P),
                                            lambda out, x=x: dist.reduce_scatter_tensor(out, x, async_op=True)),
    }
    for what, make in cases.items():
        n_used = n - n % P
        out, call = make(inputs[me][:n_used].clone())
        key = f"test/dropped/{what}"
        if me == 0:
            work = call(out)
            call = make = None  # the last references to the input
            junk = scribble()
            store.set(key, "1")
            del junk
        else:
            store.get(key)  # blocks until rank 0 has set it
            work = call(out)
        work.wait()
        if what == "all_gather":
            for r in range(P):
                assert_same(out[r], inputs[r][:n_used], f"{what} of a dropped input, part {r}")
        elif what == "all_gather_into_tensor":
            assert_same(out, torch.cat([inputs[r][:n_used] for r in range(P)]), f"{what} of a dropped input")
        elif what == "all_to_all_single":
            k = n_used // P
            want = torch.cat([inputs[r][me * k:(me + 1) * k] for r in range(P)])
            assert_same(out, want, f"{what} of a dropped input")
        elif what == "all_to_all":
            k = n_used // P
            for r in range(P):
                assert_same(out[r], inputs[r][me * k:(me + 1) * k], f"{what} of a dropped input, from {r}")
        elif what == "gather":
            if me == 0:
                for r in range(P):
                    assert_same(out[r], inputs[r][:n_used], f"{what} of a dropped input, part {r}")
        else:
            k = n_used // P
            want = sum(inputs[r][me * k:(me + 1) * k] for r in range(P))
            assert_same(out, want, f"{what} of a dropped input")


def check_bad_input(P, me):
    if not native_backend():
        for fn in (lambda: dist.all_reduce(torch.ones(3, device="meta")),
                   lambda: dist.broadcast(torch.ones(3, device="meta"), src=0)):
            expect_raises(fn, RuntimeError, "meta", "CPU")
    # (Under the per-device Backend, torch answers meta tensors itself, as it does for gloo.)
    expect_raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), TypeError, "int16", "unsupported")
    expect_raises(lambda: dist.broadcast(torch.ones(3, dtype=torch.int16), src=0), TypeError, "int16",
                  "unsupported")
    expect_raises(lambda: dist.all_gather_into_tensor(torch.ones(3 * P, dtype=torch.uint16),
                                                      torch.ones(3, dtype=torch.uint16)), TypeError, "uint16")
    # torch itself refuses ops that are not defined on complex numbers
    expect_raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.complex64), op=dist.ReduceOp.MAX),
                  ValueError, "complex")
    # ... and sends complex tensors as their real and imaginary parts.
    z = torch.complex(torch.arange(3.0) + me, torch.full((3,), float(me)))
    dist.all_reduce(z)
    want = torch.complex(sum(torch.arange(3.0) + r for r in range(P)), torch.full((3,), float(sum(range(P)))))
    assert torch.equal(z, want), z
    z = torch.complex(torch.full((2,), float(me)), torch.full((2,), -float(me)))
    dist.broadcast(z, src=P - 1)
    assert torch.equal(z, torch.complex(torch.full((2,), P - 1.0), torch.full((2,), 1.0 - P))), z
    expect_raises(lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), ValueError, "not supported")
    # AVG over bool has no meaning; every rank is told so and the group goes on.
    expect_raises(lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG), RuntimeError,
                  "AVERAGE is not defined for bool")
    x = torch.ones(2)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((2,), float(P)))


def all_reduce_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for shape in SHAPES:
                check_all_reduce(P, me, dtype, op, shape, "sync")
                n += 1
    for mode, dtype in (("wait", torch.float32), ("future", torch.int64), ("future", torch.bfloat16),
                        ("poll", torch.uint8)):
        check_all_reduce(P, me, dtype, "SUM", (33,), mode)
        n += 1
    return n


def broadcast_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for root in range(P):
            for shape in [(1,), (1001,), (2, 3)]:
                check_broadcast(P, me, dtype, root, shape, "sync")
                n += 1
    for mode in ASYNC_MODES:
        check_broadcast(P, me, torch.float64, P - 1, (9,), mode)
        n += 1
    return n


def reduce_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for root in range(P):
                check_reduce(P, me, dtype, op, root, (7,), "sync")
                n += 1
    for mode in ASYNC_MODES:
        check_reduce(P, me, torch.float32, "SUM", 1, (1001,), mode)
        n += 1
    return n


def all_gather_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for shape in [(1,), (7,), (2, 3)]:
            check_all_gather(P, me, dtype, shape, "sync")
            check_all_gather_into_tensor(P, me, dtype, shape, False, "sync")
            check_all_gather_into_tensor(P, me, dtype, shape, True, "sync")
            n += 3
    for mode in ASYNC_MODES:
        check_all_gather(P, me, torch.float16, (5,), mode)
        check_all_gather_into_tensor(P, me, torch.int32, (5,), False, mode)
        n += 2
    return n


def reduce_scatter_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            check_reduce_scatter_tensor(P, me, dtype, op, 5, "sync")
            check_reduce_scatter_list(P, me, dtype, op, (2, 3), "sync")
            n += 2
    check_reduce_scatter_tensor(P, me, torch.float32, "SUM", 1001, "sync")
    for mode in ASYNC_MODES:
        check_reduce_scatter_tensor(P, me, torch.float32, "AVG", 4, mode)
        check_reduce_scatter_list(P, me, torch.int64, "SUM", (3,), mode)
        n += 2
    return n


def all_to_all_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for uneven in (False, True):
            check_all_to_all_single(P, me, dtype, uneven, "sync")
            n += 1
        check_all_to_all_list(P, me, dtype, "sync")
        n += 1
    for mode in ASYNC_MODES:
        check_all_to_all_single(P, me, torch.float32, True, mode)
        check_all_to_all_list(P, me, torch.uint8, mode)
        n += 2
    return n


def gather_scatter_cases(P, me):
    n = 0
    for dtype in DTYPES:
        for root in range(P):
            check_gather(P, me, dtype, root, "sync")
            check_scatter(P, me, dtype, root, "sync")
            n += 2
    for mode in ASYNC_MODES:
        check_gather(P, me, torch.float32, P - 1, mode)
        check_scatter(P, me, torch.int8, P - 1, mode)
        n += 2
    return n


def check_dropped_sends(P, me):
    """isend of temporaries whose Works are dropped unwaited (a pipeline's fire-and-forget
    sends): the buffers stay valid until sent, though the receiver posts its receives only
    after the sender has dropped everything and reused the memory; every message arrives, in
    order. Then a receive completed only by polling is_completed()."""
    if torch.get_default_device().type != "cpu":
        return  # CPU tensors: the engine's point-to-point path
    store = dist.distributed_c10d._get_default_store()
    nxt, prv = (me + 1) % P, (me - 1) % P
    n, count = 300_000, 5
    for k in range(count):
        dist.isend(torch.full((n,), float(100 * me + k)), dst=nxt, tag=40)
    junk = scribble()
    store.set(f"test/dropped_sends/{me}", "1")
    del junk
    store.get(f"test/dropped_sends/{prv}")
    for k in range(count):
        got = torch.zeros(n)
        dist.recv(got, src=prv, tag=40)
        assert_same(got, torch.full((n,), float(100 * prv + k)), f"dropped isend {k} from rank {prv}")
    dist.barrier()
    got = torch.zeros(7)
    work = dist.irecv(got, src=prv, tag=41)
    dist.send(torch.full((7,), float(me)), dst=nxt, tag=41)
    deadline = time.monotonic() + 30
    while not work.is_completed():
        assert time.monotonic() < deadline, "an irecv polled with is_completed() never completed"
        time.sleep(0.001)
    assert work.is_success()
    assert_same(got, torch.full((7,), float(prv)), "irecv completed by polling")
    # wait(timeout) on a receive nobody has sent yet raises after about that long; the receive
    # stays posted and completes once the message comes.
    work = dist.irecv(got, src=prv, tag=42)
    t0 = time.monotonic()
    expect_raises(lambda: work.wait(datetime.timedelta(seconds=0.3)), RuntimeError, "timed out")
    assert time.monotonic() - t0 < 2.0, "wait(timeout=0.3 s) took more than 2 s"
    dist.barrier()
    dist.send(torch.full((7,), float(-me)), dst=nxt, tag=42)
    work.wait()
    assert_same(got, torch.full((7,), float(-prv)), "irecv completed after a timed-out wait")


def send_recv_cases(P, me):
    n = 0
    for dtype in DTYPES:
        check_send_recv(P, me, dtype, blocking=True)
        check_send_recv(P, me, dtype, blocking=False)
        n += 2
    check_batch_p2p(P, me)
    check_dropped_sends(P, me)
    return n + 2


def barrier_and_misuse_cases(P, me):
    check_barrier(P, me)
    check_non_contiguous(P, me)
    check_inputs_outlive_async_calls(P, me)
    check_bad_input(P, me)
    return 4


# Each group reports {"event": "checked", "collective", "ok", "cases", "error"} (report.py).
# Results are compared after each call completes, so a wrong result in one group leaves the
# ranks in step and the other groups still run.
GROUPS = {
    "all_reduce": all_reduce_cases,
    "broadcast": broadcast_cases,
    "reduce": reduce_cases,
    "all_gather": all_gather_cases,
    "reduce_scatter": reduce_scatter_cases,
    "all_to_all": all_to_all_cases,
    "gather_scatter": gather_scatter_cases,
    "send_recv": send_recv_cases,
    "barrier_and_misuse": barrier_and_misuse_cases,
}


def main():
    dist.init_process_group(backend="smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    assert dist.get_backend() == "smddp", dist.get_backend()
    device = "cuda" if use_test_device() else "cpu"  # SMDDP_TEST_DEVICE=cuda: the checks on this rank's GPU
    failed = 0
    for name, cases in GROUPS.items():
        try:
            report("checked", collective=name, ok=True, cases=cases(P, me), world=P, device=device)
        except AssertionError:
            failed += 1
            report("checked", collective=name, ok=False, world=P, device=device, error=traceback.format_exc())
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
