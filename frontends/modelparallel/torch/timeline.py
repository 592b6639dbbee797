"""The pipeline's own Chrome trace: when SMDDP_TIMELINE=PREFIX is set (the core's timeline
knob), each rank also writes PREFIX.smp.rank<N>.json with the spans in which its tasks hold
the compute token (what each microbatch computes, and when) and its sends and receives.
The gaps between compute spans are the pipeline's bubbles. Open in Perfetto."""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

from smdistributed.common import config

_MAX_EVENTS = 200_000


class Timeline:
    def __init__(self, rank: int):
        prefix = config.value("SMDDP_TIMELINE")
        self.path: Optional[str] = f"{prefix}.smp.rank{rank}.json" if prefix else None
        self._events: List[dict] = []
        self._lock = threading.Lock()
        self._rank = rank

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

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            events = list(self._events)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            # perf_counter's distance from the wall clock, to line up with a torch profiler
            # trace of the same run (bench/pipeline_gpu_spans.py).
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "wallMinusPerfCounterUs": (time.time() - time.perf_counter()) * 1e6}, f)
        os.replace(tmp, self.path)
