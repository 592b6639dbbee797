"""The pipeline's own Chrome trace: when SMDDP_TIMELINE=PREFIX is set (the core's timeline
knob), each rank also writes PREFIX.smp.rank<N>.json with the spans in which its tasks hold
the compute token (what each microbatch computes, and when) and its sends and receives.
The gaps between compute spans are the pipeline's bubbles. Open in Perfetto."""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

from smdistributed.common import config

_MAX_EVENTS = 200_000
# The whole trace is rewritten at each flush, so a flush per step made a step's cost grow with
# the steps before it (on 2 x H200, m = 16: 7 ms between steps after 5 steps, 22 ms after 15,
# all of it in the gap the trace showed between steps). Steps flush at most this often; the
# process's exit flushes the rest.
_FLUSH_EVERY_S = 2.0


class Timeline:
    def __init__(self, rank: int):
        prefix = config.value("SMDDP_TIMELINE")
        self.path: Optional[str] = f"{prefix}.smp.rank{rank}.json" if prefix else None
        self._events: List[dict] = []
        self._lock = threading.Lock()
        self._rank = rank
        self._flushed_at = float("-inf")
        if self.path is not None:
            atexit.register(self.flush, True)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def add(self, name: str, cat: str, start: float, end: float) -> None:
        if self.path is None:
            return
        # perf_counter is CLOCK_MONOTONIC, one clock for every process of a host: the ranks'
        # traces line up when opened together (one pid per rank).
        event = {"name": name, "cat": cat, "ph": "X", "pid": self._rank, "tid": threading.current_thread().name,
                 "ts": start * 1e6, "dur": (end - start) * 1e6}
        with self._lock:
            if len(self._events) < _MAX_EVENTS:
                self._events.append(event)

    @contextmanager
    def span(self, name: str, cat: str):
        if self.path is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter())

    def flush(self, now: bool = False) -> None:
        """Writes the trace so far: at once with `now`, else if the last write is old enough."""
        if self.path is None or not (now or time.monotonic() - self._flushed_at >= _FLUSH_EVERY_S):
            return
        self._flushed_at = time.monotonic()
        with self._lock:
            events = list(self._events)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            # perf_counter's distance from the wall clock, to line up with a torch profiler
            # trace of the same run (bench/pipeline_gpu_spans.py).
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "wallMinusPerfCounterUs": (time.time() - time.perf_counter()) * 1e6}, f)
        os.replace(tmp, self.path)
