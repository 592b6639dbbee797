"""The bridge between TensorFlow tensors and the engine's numpy arrays.

Everything the engine is handed is a numpy array (`smdistributed.common.engine`). The one
piece that touches TensorFlow's execution is `run_collective`: eagerly it calls the engine
on the tensors' numpy views directly; inside a `tf.function` (or a TF1 graph) it inserts one
`tf.numpy_function` op that does the same when the graph runs, and gives the outputs back
their static shapes. Results come back without copies where TensorFlow allows (DLPack,
64-byte aligned buffers).
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np
import tensorflow as tf

# The library's functions are plain Python around one numpy_function per call; autograph
# must not rewrite them (it would also rewrite the Python that runs inside numpy_function at
# every step, which measured 2-3x slower).
no_autograph = tf.autograph.experimental.do_not_convert

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


ALIGN = 64  # bytes: TensorFlow's buffer alignment (EIGEN_MAX_ALIGN_BYTES on AVX-512 builds)


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
    if a.ctypes.data % ALIGN:
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
# to its allocator's alignment (64 bytes with AVX-512 builds; ALIGN above); numpy only
# guarantees 16. Measured: a 50 MB output costs 3.8 ms copied and 0.6 ms adopted.


def empty_aligned(shape, dtype, always: bool = False) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary (below 4 KiB only when
    `always`)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < 4096 and not always:
        return np.empty(shape, dtype)  # small: a copy is cheaper than the padding
    raw = np.empty(nbytes + ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
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
