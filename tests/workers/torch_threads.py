"""torch.distributed calls on smddp from several threads (SMDDP_CHECK_CALLING_THREAD).

Usage: torch_threads.py CASE. c10d calls carry no names, so the backend matches them across
ranks by their order, and checks that the k-th call came from the same thread (threads
numbered per group by their first call) on every rank.

- ordered: the program fixes the order while moving calls between threads (the main thread,
  a long-lived helper thread, a fresh thread per round, and asynchronous calls still in flight
  when another thread calls): every result is exact. Reports "exact" with the calls checked.
- disorder: two helper threads whose calls reach the group in a different order on rank 0
  than on the others, with tensors of one shape: every rank raises, naming the calling
  threads, instead of reducing one thread's tensor with another's; the group then still works.
  Reports "raised" per failed call and "usable".
- handoff: one call made by helper A on rank 0 and by helper B on the others, in a fixed order
  (one call at a time). With the check on this raises on every rank, as above; with
  SMDDP_CHECK_CALLING_THREAD=0 the sum is exact ("exact").
"""
import sys
import threading

import torch
import torch.distributed as dist
from report import report
from torch_common import expect_error

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

N = 64  # elements per tensor; every call uses this shape, so only the thread check can tell


def value(rank: int, tag: int) -> torch.Tensor:
    return torch.full((N,), float(1000 * tag + rank + 1))


def expected(size: int, tag: int) -> torch.Tensor:
    return sum(value(r, tag) for r in range(size))


class Helper:
    """A thread that runs the functions it is given, one at a time, and hands back results."""

    def __init__(self, name: str):
        self._lock = threading.Condition()
        self._task, self._result = None, None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn):
        with self._lock:
            self._task, self._result = fn, None
            self._lock.notify_all()
            while self._result is None:
                self._lock.wait()
            kind, payload = self._result
        if kind == "error":
            raise payload
        return payload

    def _serve(self):
        while True:
            with self._lock:
                while self._task is None:
                    self._lock.wait()
                fn = self._task
            try:
                result = ("ok", fn())
            except Exception as e:  # handed to the caller
                result = ("error", e)
            with self._lock:
                self._task, self._result = None, result
                self._lock.notify_all()


def allreduce_checked(me: int, size: int, tag: int) -> int:
    t = value(me, tag)
    dist.all_reduce(t)
    assert torch.equal(t, expected(size, tag)), f"call {tag}: {t[0].item()} != {expected(size, tag)[0].item()}"
    return N


def ordered(me: int, size: int) -> None:
    helper = Helper("helper")
    checked = 0
    for round_ in range(20):
        base = 10 * round_
        checked += allreduce_checked(me, size, base)
        checked += helper.run(lambda: allreduce_checked(me, size, base + 1))
        fresh = threading.Thread(target=lambda: allreduce_checked(me, size, base + 2), name=f"fresh-{round_}")
        fresh.start()
        fresh.join()
        checked += N
        # In flight across threads: the main thread's asynchronous call is still pending when
        # the helper calls, in this order on every rank.
        a = value(me, base + 3)
        work = dist.all_reduce(a, async_op=True)
        b = helper.run(lambda: (lambda t: (dist.all_reduce(t, async_op=True), t))(value(me, base + 4)))
        work.wait()
        b[0].wait()
        assert torch.equal(a, expected(size, base + 3)) and torch.equal(b[1], expected(size, base + 4))
        checked += 2 * N
    report("exact", elements=checked)


def disorder(me: int, size: int) -> None:
    allreduce_checked(me, size, 0)  # the main thread is the group's thread 1 everywhere
    a, b = Helper("A"), Helper("B")
    a.run(lambda: allreduce_checked(me, size, 1))  # A is thread 2 everywhere,
    b.run(lambda: allreduce_checked(me, size, 2))  # B thread 3
    # Asynchronous calls made in a different order on rank 0 than on the others: the k-th call
    # of rank 0 is A's, of the others B's. Without the check, A's tensor on rank 0 would be
    # summed with B's on rank 1.
    order = [a, b] if me == 0 else [b, a]
    works = [h.run(lambda h=h: dist.all_reduce(value(me, 3 if h is a else 4), async_op=True)) for h in order]
    for w in works:
        expect_error(w.wait)
    allreduce_checked(me, size, 5)
    report("usable")


def handoff(me: int, size: int) -> None:
    allreduce_checked(me, size, 0)
    a, b = Helper("A"), Helper("B")
    a.run(lambda: allreduce_checked(me, size, 1))
    b.run(lambda: allreduce_checked(me, size, 2))
    caller = a if me == 0 else b
    try:
        checked = caller.run(lambda: allreduce_checked(me, size, 3))
    except RuntimeError as e:
        report("raised", message=str(e).replace("\n", " "))
        allreduce_checked(me, size, 4)
        report("usable")
        return
    report("exact", elements=checked)


def main(case: str) -> None:
    dist.init_process_group(backend="smddp")
    me, size = dist.get_rank(), dist.get_world_size()
    {"ordered": ordered, "disorder": disorder, "handoff": handoff}[case](me, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
