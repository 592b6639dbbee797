"""Buffers of operations whose handle the caller dropped before they finished.

The engine works on raw pointers. A handle (a Work) keeps the arrays or tensors it reads and
writes alive; if the caller drops the handle of an asynchronous operation without waiting,
its buffers would be freed while the engine still uses them. So a handle that dies unfinished
hands its buffers here; they are released, with the engine's record of the operation, once
the engine reports it done (checked whenever the frontend submits more work, and at
shutdown).
"""
from __future__ import annotations

import threading
from typing import Iterable


class Orphans:
    def __init__(self, engine):
        self._engine = engine
        self._held = {}  # engine handle -> the buffers it uses
        self._lock = threading.Lock()

    def adopt(self, handles: Iterable[int], keep) -> None:
        with self._lock:
            for h in handles:
                self._held[h] = keep

    def sweep(self) -> None:
        """Releases what finished. Cheap when nothing is held (the usual case)."""
        if not self._held:
            return
        with self._lock:
            for h in list(self._held):
                try:
                    finished = self._engine.poll(h)
                except Exception:  # noqa: BLE001 - already released, or the engine is gone
                    finished = True
                if finished:
                    try:
                        self._engine.release(h)
                    except Exception:  # noqa: BLE001
                        pass
                    del self._held[h]

    def __len__(self) -> int:
        return len(self._held)
