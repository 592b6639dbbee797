"""Threads for pipeline work, kept across steps.

A thread's first CUDA work costs tens of milliseconds (its cuBLAS handle and workspace are
made then), so a thread per microbatch or per served call, started each step, spends more
time starting than computing: measured on an H200, 8 encoder layers' forward took 45 ms in
a fresh thread and 3-5 ms in a reused one. Workers here live as long as the process; a task
goes to an idle worker, and a new worker starts only when all are busy (a task that waits on
a peer keeps its worker, so the pool grows to the most tasks ever in flight at once).

A thread's per-thread state (cuBLAS handles and workspaces, cuDNN's attention plans) depends
on the model, so work goes to the idle worker that was idle last (a stack, not a shared
queue): the same few threads take the same work step after step, and a thread that has never
computed is used only when more tasks run at once than ever before. With a shared queue, one
GPU's steps of the pipeline benchmark's model took 82 ms for the first dozen steps against
62 ms later (and for a plain model), as each task landed on another cold thread.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, List, Optional

import torch


class TaskHandle:
    def __init__(self):
        self._done = threading.Event()
        self.error: Optional[BaseException] = None  # what escaped the task, if anything

    def join(self, timeout: float) -> bool:
        """Waits for the task, at most `timeout` seconds; whether it is done."""
        return self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None


class WorkerPool:
    def __init__(self, device: torch.device):
        self._device = device
        # Called with what a task let escape (its own handlers report what they catch): the
        # runtime fails the step, where the task's result would otherwise be waited for forever.
        self.on_task_error: Optional[Callable[[BaseException], None]] = None
        self._lock = threading.Lock()
        self._workers: List[_Worker] = []
        self._idle: List[_Worker] = []  # a stack: the last worker to finish is the first reused

    def ensure(self, count: int) -> None:
        """Starts workers until there are `count`, and waits until the new ones are ready."""
        started = []
        with self._lock:
            while len(self._workers) < count:
                started.append(self._start())
            # Lower indexes on top: a step's first tasks go to the oldest (warmest) threads.
            self._idle.sort(key=lambda w: -w.index)
        for ready in started:
            ready.wait()

    def _start(self) -> threading.Event:
        ready = threading.Event()
        w = _Worker(len(self._workers))
        w.thread = threading.Thread(target=self._work, args=(w, ready), name=f"smp-worker-{w.index}", daemon=True)
        self._workers.append(w)
        self._idle.append(w)
        w.thread.start()
        return ready

    def submit(self, fn: Callable, *args) -> TaskHandle:
        handle = TaskHandle()
        with self._lock:
            if not self._idle:
                self._start()
            w = self._idle.pop()
        w.inbox.put((fn, args, handle))
        return handle

    def _work(self, w: _Worker, ready: threading.Event) -> None:
        if self._device.type == "cuda":
            # No cuBLAS warm-up here: a thread's first matrix product gives it a cuBLAS handle
            # and a workspace (32 MiB on Hopper) that torch keeps while the thread lives, and
            # most pool threads only wait (receivers, microbatches whose stage is elsewhere).
            # Warming every thread held 38 x 32 MiB a GPU at 16 microbatches.
            torch.cuda.set_device(self._device)
        ready.set()
        while True:
            fn, args, handle = w.inbox.get()
            try:
                fn(*args)
            except BaseException as e:  # kept in this thread: a dead worker would take the next task and never run it
                handle.error = e
                try:
                    if self.on_task_error is not None:
                        self.on_task_error(e)
                except BaseException:
                    pass  # the step is failing already
            finally:
                # An idle thread must not keep its last task alive until the next one comes:
                # a task's arguments and closure hold a microbatch's tensors and, through their
                # autograd graph, possibly its activations.
                fn = args = None
                with self._lock:
                    self._idle.append(w)
                handle._done.set()
                handle = None
