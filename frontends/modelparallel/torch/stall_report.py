"""Stall reports: a pipeline rank whose step waits with nothing moving says what waits.

A stage may compute for longer than SMDDP_TIMEOUT while its peers wait (links that stay quiet
are not failures, see wire.QuietLink), and a peer that is stopped or dead is found by the
engine's pings. What neither catches is a rank that is alive but stuck: a CUDA operation that
never ends, user code that blocks, or ranks that disagree about the step. Their peers would
wait without a word. So while a step runs, a rank on which nothing arrived from its peers and
no compute started or ended for SMDDP_STALL_WARNING seconds, and which is not computing now,
logs what each of its waiting tasks waits for, and logs again each such period. A rank that
computes says nothing (stuck in a CUDA operation or not, it is what the others wait for: their
reports name it). It is a warning, never an error: the peers of a merely slow stage get one too.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

log = logging.getLogger("smdistributed.modelparallel")


class StallReport:
    def __init__(self, after_s: float):
        self.after_s = after_s  # 0 or less: never report
        self.header: Callable[[], str] = lambda: "smp"  # names the rank and step (set by the runtime)
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._waits: Dict[int, Tuple[str, tuple, float]] = {}  # key -> (format, its arguments, since)
        self.new_step()

    def new_step(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._started_at = self._heard_at = now
            self._reported_at = 0.0
        self.heard_this_step = False

    def heard(self) -> None:
        """A message arrived from a peer."""
        self._heard_at = time.perf_counter()
        self.heard_this_step = True

    def waiting(self, what: str, *args) -> "_Waiting":
        """Marks the calling task as waiting until the block ends; `what.format(*args)` says for
        what (formatted only for a report: the waits are on every microbatch's path, which is
        also why this is a plain class and not a generator context manager)."""
        return _Waiting(self, what, args)

    def check(self, token, extra: Callable[[], List[str]]) -> Optional[str]:
        """Logs (and returns) a report if the step has stood still for the period and none was
        logged during the last one; `token` is the compute token, `extra` what else waits."""
        if self.after_s <= 0 or token.computing():
            return None
        now = time.perf_counter()
        with self._lock:
            quiet = now - max(self._heard_at, self._started_at, token.changed_at)
            if quiet < self.after_s or now - self._reported_at < self.after_s:
                return None
            waits = [f"{what.format(*args)} (for {now - since:.0f} s)" for what, args, since in self._waits.values()]
        waits += extra()
        if not waits:
            return None  # nothing here waits for a peer: this rank is not part of a stall
        self._reported_at = now
        report = (f"smp: {self.header()}: nothing arrived from the other pipeline ranks and no compute started "
                  f"or ended here for {quiet:.0f} s (SMDDP_STALL_WARNING={self.after_s:g}), and nothing computes "
                  f"here. {token.describe()}Waiting: {'; '.join(waits)}. A stage that computes this long is only "
                  "slow; otherwise a rank is stuck (in user code or a CUDA operation) or the ranks are not running "
                  "the same step.")
        log.warning(report)
        return report


class _Waiting:
    """One wait of StallReport.waiting, listed while its block runs."""
    __slots__ = ("_report", "_entry", "_key")

    def __init__(self, report: StallReport, what: str, args: tuple):
        self._report, self._entry = report, (what, args)

    def __enter__(self) -> None:
        report = self._report
        self._key = next(report._keys)
        with report._lock:
            report._waits[self._key] = (*self._entry, time.perf_counter())

    def __exit__(self, *exc) -> None:
        with self._report._lock:
            del self._report._waits[self._key]
