"""Process state of the TensorFlow frontend: init/shutdown, the world, the process sets.

This module holds what one process knows about the job (its engine, rank, size, the cross
communicator's shape); the only collective it runs is init's exchange of that shape. The
operations (ops.py) read the state through `core()`.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import numpy as np

from smdistributed.common import engine

SmddpError = engine.SmddpError


class NotInitializedError(ValueError, RuntimeError):
    """An API call before `init()` (a ValueError, as Horovod raises, and a RuntimeError)."""


class AlreadyInitializedError(RuntimeError):
    """A second `init()` in one process."""


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.core: Optional[engine.Core] = None
        self.init_called = False
        self.shut_down = False
        self.cross_rank = 0
        self.cross_size = 1
        self.homogeneous = True


_state = _State()


def init(comm=None, process_sets=None) -> None:
    """Starts the library: discovers this process's rank and size from the launcher's
    environment (smddprun, mpirun, torchrun, Slurm, SageMaker, ...) and connects to the other
    ranks. A second call raises `AlreadyInitializedError`.

    `comm` and `process_sets` (Horovod's arguments) are accepted for source compatibility;
    only the global set of ranks is supported, so they must be None / empty.
    """
    if comm not in (None, [], ()) or process_sets not in (None, [], (), "dynamic"):
        raise NotImplementedError("smdistributed.dataparallel.tensorflow.init(): sub-communicators and "
                                  "process sets are not supported; every operation spans all ranks")
    with _state.lock:
        if _state.init_called:
            raise AlreadyInitializedError(
                "smdistributed.dataparallel.tensorflow.init() was already called in this process; "
                "call it once, before any other function of the library")
        core = engine.init()
        # The cross communicator (Horovod): ranks with the same local rank, one per host.
        topo = core.allgather(np.array([[core.local_rank, core.host_index, core.local_size]], np.int64),
                              name="tf.init.topology") if core.size > 1 else \
            np.array([[core.local_rank, core.host_index, core.local_size]], np.int64)
        same_local = [int(h) for lr, h, _ in topo if lr == core.local_rank]
        _state.cross_size = len(same_local)
        _state.cross_rank = sorted(same_local).index(core.host_index)
        _state.homogeneous = len({int(ls) for _, _, ls in topo}) == 1
        _state.core = core
        _state.init_called = True
    if os.environ.get("SMDDP_TF_KERAS_COMPAT", "1") != "0":
        from . import compat

        compat.install()


def shutdown() -> None:
    """Stops the engine of this process. Safe to call more than once (and without init)."""
    with _state.lock:
        if _state.core is not None and not _state.shut_down:
            _state.shut_down = True
            _state.core = None
            engine.shutdown()


def is_initialized() -> bool:
    return _state.core is not None


def core() -> engine.Core:
    c = _state.core
    if c is None:
        if _state.shut_down:
            raise NotInitializedError("smdistributed.dataparallel.tensorflow was shut down; no operation can "
                                      "run after shutdown()")
        raise NotInitializedError("smdistributed.dataparallel.tensorflow is not initialized: call "
                                  "smdistributed.dataparallel.tensorflow.init() first")
    return c


def size() -> int:
    """Number of processes in the job."""
    return core().size


def local_size() -> int:
    """Number of processes on this host."""
    return core().local_size


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    return core().rank


def local_rank() -> int:
    """This process's rank among the processes of its host (pin one GPU per process with it)."""
    return core().local_rank


def cross_size() -> int:
    """Number of processes with this process's local rank (one per host on uniform hosts)."""
    core()
    return _state.cross_size


def cross_rank() -> int:
    """Index of this process among those with its local rank (the host index on uniform hosts)."""
    core()
    return _state.cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    core()
    return _state.homogeneous


# ---- process sets ------------------------------------------------------------------------
#
# Horovod's process sets name subsets of ranks; this library runs every operation on all
# ranks, so the only set is the global one and the calls that would make others refuse.


class ProcessSet:
    """Horovod's process sets; only the global one (all ranks) exists here."""

    def __init__(self, ranks=None):
        if ranks is not None:
            raise NotImplementedError("process sets other than the global one are not supported")

    def __repr__(self):
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def add_process_set(process_set):
    raise NotImplementedError("process sets other than the global one are not supported")


def remove_process_set(process_set):
    raise NotImplementedError("process sets other than the global one are not supported")


def check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process sets are not supported: every operation spans all ranks "
                                  "(pass global_process_set or nothing)")
