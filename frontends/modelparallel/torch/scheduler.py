"""Which piece of pipeline work runs next on this rank.

Every microbatch's step function, and every module call served for a peer, runs in its own
thread (a call may wait on a peer in the middle of Python code, so each needs its own stack).
Only one of them computes at a time: it holds the compute token, and gives it back whenever
it waits on a peer. The waiting task with the smallest priority gets the token next, so the
order of work is decided by the schedule, not by thread timing:

    "simple": forward work before backward work, then the oldest microbatch;
    "interleaved": the oldest microbatch, its backward before later forwards.

Under "simple" every backward is held until all forwards are done (GPipe), so only the
microbatch order matters there. Under "interleaved" the oldest microbatch goes first, its
backward included: a stage runs a microbatch's backward as soon as its gradient is there,
before the forwards of later microbatches (1F1B), and admits at most `active_microbatches`
microbatches at once, holding the activations of only that many. (Forward work first under
"interleaved", used until 2026-11-25, made the last stage serve every queued forward before
the first backward: on 2 CPU processes at 4 microbatches the stages ran F0 F1 F2 F3 B0 B1 B2
B3, a GPipe schedule; oldest-first runs F0 F1 B0 F2 B1 ...) A plain backward-first order,
tried before either, left the last stage's next forward behind every backward it had queued.
A task that goes from its forward into its backward keeps the token unless older work waits
(runtime.model_backward): handing it over let a queued later forward run a layer first.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Optional, Tuple

FORWARD = "fwd"
BACKWARD = "bwd"


def priority(phase: str, mb: int, pipeline: str) -> Tuple[int, int]:
    if pipeline == "interleaved":
        return (mb, 0 if phase == FORWARD else 1)
    return (0 if phase == FORWARD else 1, mb)


class ComputeToken:
    """The right to compute, handed directly to the waiting task of smallest priority.

    Each waiter sleeps on its own event and the releaser wakes only the one it hands the token
    to. (One condition variable shared by all, notified on every release, woke every waiting
    thread to re-check its place, each queueing for the GIL: `bench/token_handoff.py` measured
    a hand-off at 107 us median with 16 tasks waiting and 211 us with 32, against 10-13 us
    now whatever the number waiting.)
    """

    def __init__(self, aborted: Callable[[], Optional[BaseException]], timeline=None,
                 on_release: Optional[Callable[[], None]] = None):
        self._timeline = timeline
        self._on_release = on_release  # run by the holder before it lets go (while nobody else computes)
        self._since = 0.0
        self._label = ""
        self.changed_at = time.perf_counter()  # when the token last changed hands (stall reports)
        self._lock = threading.Lock()
        self._holder: Optional[int] = None
        self._queue: list = []  # heap of (priority, seq, thread id, event, label)
        self._seq = itertools.count()
        self._aborted = aborted
        self._expected: Dict[Any, float] = {}  # priority of a task about to ask -> until when to wait for it

    def expect(self, prio, within: float = 0.05) -> None:
        """A task of priority `prio` is about to ask for the token (a thread that was just handed
        the value it waited for, still waking up): until it asks, or for `within` seconds at most,
        the token goes to no task of larger priority. Without this, the thread that hands over
        the value takes the token back for its next, newer work before the woken one gets there.
        (Measured on 2 x H200: the last stage's runner started the next microbatch's forward
        before the loss and backward of the one it had just finished, one layer's activations
        more at the stage's peak and one layer's delay for the backward the first stage waits on.)"""
        with self._lock:
            self._expected[prio] = time.perf_counter() + within

    def _older_expected(self, prio) -> bool:
        """Whether a task older than `prio` is about to ask (caller holds the lock)."""
        if not self._expected:
            return False
        now = time.perf_counter()
        for p in [p for p, until in self._expected.items() if until < now]:
            del self._expected[p]  # it did not come in time: stop holding the token for it
        return any(p < prio for p in self._expected)

    def _next_wait(self) -> float:
        """How long a waiter sleeps before it looks again (caller holds the lock): until the
        first expectation runs out, if the token may be held back for it; else half a second
        (the abort check)."""
        if not self._expected:
            return 0.5
        return min(0.5, max(0.001, min(self._expected.values()) - time.perf_counter() + 0.001))

    def acquire(self, prio, label: str = "") -> None:
        me = threading.get_ident()
        with self._lock:
            self._expected.pop(prio, None)
            if self._holder is None and not self._queue and not self._older_expected(prio):
                self._take(label)
                return
            entry = (prio, next(self._seq), me, threading.Event(), label)
            heapq.heappush(self._queue, entry)
            if self._holder is None:  # held back for an expected task: this may be it, or come after it
                self._hand_over()
            timeout = self._next_wait()
        event = entry[3]
        while True:
            event.wait(timeout)
            with self._lock:
                if self._holder is None:
                    self._hand_over()  # an expected task that never came
                if self._holder == me:
                    self._take(label)
                    return
                event.clear()  # woken by wake(): look at the abort flag, then wait again
                timeout = self._next_wait()
            if (err := self._aborted()) is not None:
                with self._lock:
                    if self._holder == me:  # handed over meanwhile: pass it on
                        self._hand_over()
                    else:
                        self._queue.remove(entry)
                        heapq.heapify(self._queue)
                raise err

    def _take(self, label: str) -> None:
        self._holder = threading.get_ident()
        self._since, self._label = time.perf_counter(), label
        self.changed_at = self._since

    def computing(self) -> bool:
        return self._holder is not None

    def describe(self) -> str:
        """Who waits to compute, for a stall report."""
        with self._lock:
            queued = [e[4] for e in sorted(self._queue)]
        return f"Waiting to compute: {', '.join(repr(q) for q in queued)}. " if queued else ""

    def _hand_over(self) -> None:
        """To the first waiter, or to nobody: none waits, or an older task is about to ask
        (caller holds the lock)."""
        self.changed_at = time.perf_counter()
        if self._queue and not self._older_expected(self._queue[0][0]):
            _, _, thread, event, _ = heapq.heappop(self._queue)
            self._holder = thread
            event.set()
        else:
            self._holder = None

    def relabel(self, label: str) -> None:
        """The holder goes on with other work (a microbatch's backward after its forward): the
        timeline closes the interval so far and opens one under the new label."""
        with self._lock:
            if self._holder == threading.get_ident():
                now = time.perf_counter()
                if self._timeline is not None:
                    self._timeline.add(self._label, "compute", self._since, now)
                self._since, self._label = now, label

    def anyone_waits(self) -> bool:
        """Whether any task waits for the token or is expected to ask (read without the lock:
        a hint, for a fast path; older_work_waits decides)."""
        return bool(self._queue) or bool(self._expected)

    def older_work_waits(self, prio) -> bool:
        """Whether a task of smaller priority (older work) waits for the token."""
        with self._lock:
            return (bool(self._queue) and self._queue[0][0] < prio) or self._older_expected(prio)

    def release(self) -> None:
        if self._on_release is not None and self._holder == threading.get_ident():
            self._on_release()
        with self._lock:
            if self._holder == threading.get_ident():
                if self._timeline is not None:
                    self._timeline.add(self._label, "compute", self._since, time.perf_counter())
                self._hand_over()

    def wake(self) -> None:
        """Every waiter looks at the abort flag now, not at its next timeout."""
        with self._lock:
            for entry in self._queue:
                entry[3].set()

    @contextmanager
    def held(self, prio):
        self.acquire(prio)
        try:
            yield
        finally:
            self.release()


class Waiter:
    """A value that a receiver thread delivers to a task, or an error that ends the step."""

    def __init__(self, what: str):
        self.what = what
        self._done = threading.Event()
        self._value = None
        self._error: Optional[BaseException] = None
        self._claimed = False

    def set(self, value) -> None:
        self._value = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def wait(self, aborted: Callable[[], Optional[BaseException]]):
        while not self._done.wait(0.5):
            if (err := aborted()) is not None:
                raise err
        if self._error is not None:
            raise self._error
        # One consumer: the message's tensors (an output copy, input gradients) are not kept
        # until the end of the step (the runtime keeps its waiters until then).
        self._claimed = True
        value, self._value = self._value, None
        return value

    def unclaimed(self):
        """The value that arrived if nobody waited for it, else None."""
        if self._done.is_set() and self._error is None and not self._claimed:
            return self._value
        return None


class ArrivalOrder:
    """Tickets that make forward calls start in the order they arrived, when they go to
    different threads (the last stage's step functions serve their own output calls, serve
    runners the others: runtime.py).

    The receiver issues a ticket per call; a call's thread waits until every call with an
    earlier ticket has passed its turn (taken the compute token, or begun to wait for a place
    in the stage's window, where waiters enter in microbatch order). Without it, the thread of
    a later call that woke first could take a free token before the earlier one's thread got
    up: BatchNorm's running statistics and the gradients' order of summation depend on the
    order forwards run in. No timeout lets the order slip; the wait ends only with the step's
    abort.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._issued = 0
        self._passed = 0

    def issue(self) -> int:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            return ticket

    def wait_turn(self, ticket: int, aborted: Callable[[], Optional[BaseException]]) -> None:
        if self._passed == ticket:  # (it only grows: the common case needs no lock)
            return
        with self._cond:
            while self._passed != ticket:
                if (err := aborted()) is not None:
                    raise err
                self._cond.wait(0.5)

    def passed(self, ticket: int) -> None:
        """`ticket`'s call has taken its turn (or failed): the next may go."""
        with self._cond:
            if self._passed == ticket:
                self._passed += 1
                self._cond.notify_all()

    def wake(self) -> None:
        """Waiters look at the abort flag now."""
        with self._cond:
            self._cond.notify_all()
