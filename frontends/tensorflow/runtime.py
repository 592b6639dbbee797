"""Process state of the TensorFlow frontend: init/shutdown, the world, operation names, the bridge.

Everything here is plain Python over `smdistributed.common.engine` (numpy based). The one
piece that touches TensorFlow's execution is `run_collective`: eagerly it calls the engine
on the tensors' numpy views directly; inside a `tf.function` (or a TF1 graph) it inserts one
`tf.numpy_function` op that does the same when the graph runs, and gives the outputs back
their static shapes.
"""
from __future__ import annotations

import enum
import os
import threading
import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from smdistributed.common import engine

SmddpError = engine.SmddpError

# The library's functions are plain Python around one numpy_function per call; autograph
# must not rewrite them (it would also rewrite the Python that runs inside numpy_function at
# every step, which measured 2-3x slower).
no_autograph = tf.autograph.experimental.do_not_convert


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


# ---- reduce ops --------------------------------------------------------------------------


class ReduceOp(enum.Enum):
    """Reductions. SMDDP's names (AVERAGE, SUM, MIN, MAX) plus PRODUCT; Horovod's module
    constants `Average, Sum, Min, Max, Product` are these members."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    def __repr__(self):
        return f"ReduceOp.{self.name}"


def resolve_op(op, average=None) -> ReduceOp:
    """`op` (a ReduceOp, its name, or None) combined with Horovod's deprecated `average=`."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    if isinstance(op, str):
        key = op.strip().upper()
        key = {"AVG": "AVERAGE", "MEAN": "AVERAGE", "PROD": "PRODUCT"}.get(key, key)
        try:
            op = ReduceOp[key]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.AVERAGE, SUM, MIN, MAX or PRODUCT") from None
    if not isinstance(op, ReduceOp):
        raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.AVERAGE, SUM, MIN, MAX or PRODUCT")
    if op is ReduceOp.ADASUM:
        raise NotImplementedError("the Adasum reduction is not implemented; use ReduceOp.AVERAGE or SUM")
    return op


def check_process_set(process_set) -> None:
    from .ops import global_process_set

    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process sets are not supported: every operation spans all ranks "
                                  "(pass global_process_set or nothing)")


# ---- names -------------------------------------------------------------------------------
#
# Ranks match operations by name. Eagerly, an unnamed operation takes the next number of a
# per-kind call counter (ranks run the same code, so the n-th call is the same operation on
# every rank). In a graph, the name is fixed when the op is traced: the outermost function's
# name plus a counter of the collectives traced into that function so far. Retracing a
# function starts its counter again, so names do not depend on how often a rank traced, and
# the ops of one function run in program order (TensorFlow chains stateful ops), so a name
# is never in flight twice.

_graph_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_graph_lock = threading.Lock()


try:
    from tensorflow.python.framework.func_graph import FuncGraph as _FuncGraph
except ImportError:  # pragma: no cover
    _FuncGraph = None


def _is_func_graph(graph) -> bool:
    if _FuncGraph is not None:
        return isinstance(graph, _FuncGraph)
    return type(graph).__name__ == "FuncGraph"


def _outermost_graph(graph):
    while _is_func_graph(graph):
        outer = getattr(graph, "outer_graph", None)
        if outer is None or not _is_func_graph(outer):
            return graph
        graph = outer
    return graph


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in s)


def op_name(kind: str, name: Optional[str] = None) -> str:
    """A name for a collective that is the same on every rank (see above)."""
    if name is not None:
        return f"tf.{kind}.{name}"
    if tf.executing_eagerly():
        return core()._auto_name(f"tf.{kind}", None)
    graph = tf.compat.v1.get_default_graph()
    top = _outermost_graph(graph)
    with _graph_lock:
        n = _graph_counters.get(top, 0)
        _graph_counters[top] = n + 1
    label = _safe(getattr(top, "name", "") or "graph") if _is_func_graph(top) else "graph"
    return f"tf.{kind}.{label}.{n}"


# ---- the bridge into the engine ----------------------------------------------------------

SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64,
                    tf.bool)


def check_dtype(tensor, what: str = "tensor") -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} has dtype {tensor.dtype.name}, which the engine does not reduce or move; "
                        "supported: float16, bfloat16, float32, float64, int8, uint8, int32, int64, bool")


def _check_not_xla() -> None:
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover
        return
    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise RuntimeError(
            "smdistributed.dataparallel.tensorflow collectives cannot run inside an XLA-compiled function "
            "(jit_compile=True): compile the model with jit_compile=False (Keras: model.compile(..., "
            "jit_compile=False)) or call the collective outside the compiled function")


_ALIGN = 64  # bytes: TensorFlow's buffer alignment (EIGEN_MAX_ALIGN_BYTES on AVX-512 builds)


def eager_to_numpy(t) -> np.ndarray:
    """A numpy view of an eager tensor's buffer (no copy; `.numpy()` copies). Read only by
    the engine."""
    view = getattr(t, "_numpy", None)
    if view is not None:
        try:
            return view()
        except Exception:  # noqa: BLE001 - e.g. a tensor on another device: copy below
            pass
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def numpy_to_eager(a: np.ndarray, dtype) -> tf.Tensor:
    """An eager tensor over the array's buffer when it is 64-byte aligned (DLPack, no copy;
    converting copies: 17 ms for 50 MB here); bfloat16, which numpy cannot export, goes as
    uint16 and is bitcast. Unaligned arrays are copied (TF kernels check alignment)."""
    if a.ctypes.data % _ALIGN:
        return tf.convert_to_tensor(a, dtype=dtype)  # TF kernels require aligned buffers
    try:
        if a.dtype.name == "bfloat16":
            return tf.bitcast(tf.experimental.dlpack.from_dlpack(a.view(np.uint16).__dlpack__()), tf.bfloat16)
        t = tf.experimental.dlpack.from_dlpack(a.__dlpack__())
        if t.dtype == dtype:
            return t
    except Exception:  # noqa: BLE001 - no DLPack for this dtype or version: copy
        pass
    return tf.convert_to_tensor(a, dtype=dtype)


def run_collective(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor], out_dtypes: List,
                   out_shapes: List, name: str = "smddp") -> List[tf.Tensor]:
    """Runs `fn(*numpy_inputs) -> numpy outputs` now (eager) or when the graph runs."""
    body0 = fn

    def fn(*arrays):  # 0-d tensors arrive as numpy scalars (eagerly and in numpy_function)
        return body0(*[a if isinstance(a, np.ndarray) else np.asarray(a) for a in arrays])

    if tf.executing_eagerly():
        outs = fn(*[eager_to_numpy(t) for t in inputs])
        return [numpy_to_eager(o, d) for o, d in zip(outs, out_dtypes)]
    _check_not_xla()

    if not out_dtypes:
        # numpy_function needs an output: a dummy int8 scalar, returned so that callers can
        # depend on it (TF1 graphs) or ignore it (tf.function runs stateful ops anyway).
        body = fn

        def fn(*arrays):
            body(*arrays)
            return np.zeros((), np.int8)

        out = tf.numpy_function(fn, list(inputs), tf.int8, stateful=True, name=name)
        out.set_shape([])
        return [out]
    outs = tf.numpy_function(fn, list(inputs), list(out_dtypes), stateful=True, name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    outs = list(outs)
    for o, s in zip(outs, out_shapes):
        if s is not None:
            o.set_shape(s)
    return outs


# TensorFlow adopts a numpy_function's output buffer without copying only when it is aligned
# to its allocator's alignment (64 bytes with AVX-512 builds; _ALIGN above); numpy only
# guarantees 16. Measured: a 50 MB output costs 3.8 ms copied and 0.6 ms adopted.


def empty_aligned(shape, dtype, always: bool = False) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary (below 4 KiB only when
    `always`)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < 4096 and not always:
        return np.empty(shape, dtype)  # small: a copy is cheaper than the padding
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % _ALIGN
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def wait_all(works) -> list:
    """Waits for every Work (even after one fails, so no buffer is freed while the engine still
    uses it) and returns their results, raising the first failure afterwards."""
    results, first_error = [], None
    for w in works:
        try:
            results.append(w.wait())
        except Exception as e:  # noqa: BLE001
            results.append(None)
            if first_error is None:
                first_error = e
    if first_error is not None:
        raise first_error
    return results
