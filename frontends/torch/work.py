"""Work handles for the smddp process group, and the thread that completes their futures.

A Work wraps one or more engine handles. wait() blocks in the engine (GIL released); the
torch Future that get_future() returns is completed by one background thread per engine,
which the engine wakes as operations finish, so DDP's communication hooks chain on it
without anyone calling wait().
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable, List, Optional

import torch
import torch.distributed as dist


_running = set()  # CompletionThreads not yet stopped


@atexit.register
def _stop_all() -> None:
    # A daemon thread still inside the engine when the interpreter finalizes is ended by
    # pthread_exit as it takes the GIL back, which unwinds through pybind11's noexcept frames
    # and aborts the process ("terminate called without an active exception"). Scripts that
    # never call destroy_process_group() would all end that way.
    for t in list(_running):
        t.stop()


class CompletionThread:
    """Completes the futures of an engine's watched operations as they finish."""

    def __init__(self, engine):
        self._engine = engine
        self._works = {}  # handle -> Work
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="smddp-completions", daemon=True)
        _running.add(self)
        self._thread.start()

    def watch(self, work: "SmddpWork", handle: int) -> None:
        with self._lock:
            self._works[handle] = work
        self._engine.watch(handle)

    def stop(self) -> None:
        """Ends the thread once it has handed out what already completed (joined, unless called
        from a future's callback on the thread itself)."""
        self._stop = True
        _running.discard(self)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                done = self._engine.next_completions(0.2)
            except Exception:  # engine shut down
                return
            if self._stop and not done:
                return
            for handle in done:
                with self._lock:
                    work = self._works.pop(handle, None)
                if work is not None:
                    work._handle_finished(handle)


class SmddpWork(dist.Work):
    """Handles of one collective call; `result` is what its future holds on success."""

    def __init__(self, pg, handles: List[int], result, finish: Optional[Callable[[], None]] = None,
                 keep=()):
        super().__init__()
        # The engine holds only raw pointers: inputs and staging copies must outlive the
        # operation even when the caller drops them (dist.all_gather(outs, x.clone(), async_op=True)).
        self._keep = keep
        self._pg = weakref.ref(pg)
        self._engine = pg._core._engine
        self._pending = list(handles)
        self._result = result
        self._finish = finish  # copies results into the caller's tensors, once
        self._error: Optional[Exception] = None
        self._done = False
        self._lock = threading.RLock()
        self._future: Optional[torch.futures.Future] = None
        self._future_source: Optional[torch.futures.Future] = None  # completed to run _future_value

    def __del__(self):
        # Dropped before it finished (an async call never waited on): the buffers the engine
        # still uses must outlive it.
        if getattr(self, "_done", True) or not getattr(self, "_pending", None):
            return
        pg = self._pg()
        if pg is not None:
            pg._orphans.adopt(list(self._pending), (self._keep, self._finish))

    def after_results(self, fn: Callable[[], None], restate: Callable) -> None:
        """`fn` runs once the results are in this Work's tensors, before wait() returns or the
        future completes; `restate` maps the value the future will hold. Only before anyone
        waits (host_staging.py copies results back to the caller's GPU tensors this way)."""
        earlier = self._finish
        self._finish = fn if earlier is None else (lambda: (earlier(), fn()))
        self._result = restate(self._result)

    # -- completion, from wait() or from the completion thread -----------------------------
    def _complete_handle(self, handle: int) -> None:
        try:
            self._engine.wait(handle, -1.0)
        except Exception as e:  # the engine's message names the tensor and the failure
            if self._error is None:
                self._error = RuntimeError(str(e))

    def _finalize(self) -> None:
        # The copy into the caller's tensors runs once: a later get_future() must not redo it
        # over whatever the caller has written there since.
        finish, self._finish = self._finish, None
        if self._error is None and finish is not None:
            try:
                finish()
            except Exception as e:
                self._error = e
        self._done = True
        self._keep = None
        if self._future_source is not None and not self._future_source.done():
            self._future_source.set_result(None)  # runs _future_value for the future handed out

    def _future_value(self, _source):
        # The future handed out is this callback's: a Python exception raised here marks it
        # failed in C++ (as gloo's and NCCL's futures fail), so DDP's reducer and every hook
        # see the error. (torch.futures.Future.set_exception only stores the exception as a
        # value that Python unwraps; C++ readers would take it for tensors and crash.)
        if self._error is not None:
            raise self._error
        return self._result

    def _handle_finished(self, handle: int) -> None:
        with self._lock:
            if handle in self._pending:
                self._pending.remove(handle)
                self._complete_handle(handle)
                if not self._pending:
                    self._finalize()

    # -- torch's Work interface -------------------------------------------------------------
    def wait(self, timeout=None) -> bool:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout or 0)
        if seconds > 0:  # torch's default, 0, is no limit
            self._wait_done(seconds)
        with self._lock:
            while self._pending:
                self._complete_handle(self._pending.pop(0))
            if not self._done:
                self._finalize()
        if self._error is not None:
            raise self._error
        return True

    def _wait_done(self, seconds: float) -> None:
        """Until the engine has finished every handle, or raises after `seconds` (the operation
        stays posted: a later wait can still complete it)."""
        deadline = time.monotonic() + seconds
        # A handle the completion thread has released meanwhile counts as finished.
        for h in list(self._pending):
            if not self._engine.wait_done(h, max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"smddp: operation timed out after {int(seconds * 1000)} ms")

    def is_completed(self) -> bool:
        with self._lock:
            if self._done:
                return True
            if not all(self._engine.poll(h) for h in self._pending):
                return False
            # Done in the engine: copy the results out now, so that a caller who polls and then
            # reads its tensors (without wait()) finds them there.
            while self._pending:
                self._complete_handle(self._pending.pop(0))
            self._finalize()
            return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                self._future_source = torch.futures.Future()
                self._future = self._future_source.then(self._future_value)
                if self._done:
                    self._finalize()
                else:
                    pg = self._pg()
                    for h in list(self._pending):
                        pg._completions().watch(self, h)
            return self._future
