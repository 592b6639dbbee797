"""The collectives API on TensorFlow tensors, eager or inside `tf.function`.

Each public function turns its tensors into one call into the engine (see
`bridge.run_collective`): several tensors of one call are submitted together without
waiting and then awaited, so the engine can fuse them. Dense allreduce, allgather and
broadcast are differentiable (their gradients are the matching collectives), as in Horovod.
How a grouped reduction's tensors are packed is in buckets.py; the check that every rank
passed the same tensors, and its error, in mismatch.py.
"""
from __future__ import annotations

import pickle
import time
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from smdistributed.common.config import default_bucket_bytes

from .bridge import check_dtype, empty_aligned, no_autograph, run_collective, wait_all
from .buckets import submit_dense
from .compression import Compression, NoneCompressor
from .mismatch import mismatch_error, signature
from .naming import op_name
from .reduce_ops import ReduceOp, resolve_op
from .runtime import SmddpError, check_process_set, core, rank, size


def _as_tensor(x):
    if isinstance(x, tf.IndexedSlices):
        return x
    return tf.convert_to_tensor(x)


def _check_root(root_rank: int) -> int:
    n = size()
    root = int(root_rank)
    if not 0 <= root < n:
        raise ValueError(f"root_rank {root_rank} is not a rank of this job of {n} processes")
    return root


# ---- grouped reduction (dense allreduce + sparse allgather in one engine call) ------------


@no_autograph
def reduce_tensors(tensors: Sequence, *, op=ReduceOp.AVERAGE, compression=Compression.none,
                   sparse_as_dense: bool = False, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                   kind: str = "grouped_allreduce", name: Optional[str] = None,
                   bucket_bytes: Optional[int] = None) -> List:
    """Reduces a list of tensors (None entries stay None) in one hand-off to the engine.

    Dense tensors are allreduced (compressed for the wire first), packed into buckets of up
    to `bucket_bytes` per dtype (see buckets.py); `tf.IndexedSlices` are densified when
    `sparse_as_dense`, otherwise their values and indices are allgathered and the values
    divided by the world size for AVERAGE, which represents the same sum.
    """
    op = resolve_op(op)
    compression = compression or NoneCompressor
    results: List = [None] * len(tensors)
    dense_pos, dense_in, ctxs = [], [], []
    sparse_pos, sparse_in = [], []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if isinstance(t, tf.IndexedSlices):
            if sparse_as_dense:
                t = tf.convert_to_tensor(t)
            else:
                if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
                    raise NotImplementedError(
                        f"{op.name} of tf.IndexedSlices is not supported (they are allgathered, which "
                        "represents a sum); pass sparse_as_dense=True to reduce them as dense tensors")
                check_dtype(t.values, "IndexedSlices values")
                check_dtype(t.indices, "IndexedSlices indices")
                sparse_pos.append(i)
                sparse_in.append(t)
                continue
        t = tf.convert_to_tensor(t)
        check_dtype(t)
        compressed, ctx = compression.compress(t)
        dense_pos.append(i)
        dense_in.append(compressed)
        ctxs.append(ctx)
    if not dense_in and not sparse_in:
        return results

    base = op_name(kind, name)
    n_dense = len(dense_in)
    op_str = op.value
    pre, post = float(prescale_factor), float(postscale_factor)

    cap = int(bucket_bytes) if bucket_bytes else default_bucket_bytes()

    def fn(*arrays):
        c = core()
        dense = arrays[:n_dense]
        outs, works, sig_work = [], [], None
        try:
            sig, sig_out = signature(dense)
            sig_work = c.allreduce(sig, "max", name=f"{base}.shapes", out=sig_out, async_op=True)
            outs = submit_dense(c, dense, op_str, base, pre, post, cap, works)
            for j in range(len(sparse_in)):
                for part, a in (("values", arrays[n_dense + 2 * j]), ("indices", arrays[n_dense + 2 * j + 1])):
                    works.append(c.allgather(a, name=f"{base}.sparse{j}.{part}", async_op=True))
        except BaseException:
            wait_all(works + ([sig_work] if sig_work is not None else []))  # buffers stay alive until done
            raise
        try:
            wait_all([sig_work])
            sig_error = None
        except SmddpError as e:
            sig_error = e
        try:
            done = wait_all(works)
        except SmddpError as e:
            sig_error = sig_error or e
        if sig_error is not None or not np.array_equal(sig_out, sig):
            raise mismatch_error(c, base, dense, sig, sig_out, sig_error)
        return outs + done[len(works) - 2 * len(sparse_in):]

    inputs = list(dense_in)
    shapes = [t.shape for t in dense_in]
    for s in sparse_in:
        inputs += [s.values, s.indices]
        shapes += [tf.TensorShape([None]).concatenate(s.values.shape[1:]), tf.TensorShape([None])]
    outs = run_collective(fn, inputs, [t.dtype for t in inputs], shapes, name="SmddpAllreduce")

    for k, i in enumerate(dense_pos):
        results[i] = compression.decompress(outs[k], ctxs[k])
    for j, i in enumerate(sparse_pos):
        values, indices = outs[n_dense + 2 * j], outs[n_dense + 2 * j + 1]
        scale = pre * post / (size() if op is ReduceOp.AVERAGE else 1)
        if scale != 1.0:
            values = values * tf.cast(scale, values.dtype)
        results[i] = tf.IndexedSlices(values, indices, dense_shape=sparse_in[j].dense_shape)
    return results


def _differentiable(x) -> bool:
    return isinstance(x, tf.Tensor) and (x.dtype.is_floating or x.dtype.is_complex)


@no_autograph
def _allreduce_one(tensor, op: ReduceOp, compression, pre, post, kind, name):
    if isinstance(tensor, tf.IndexedSlices) or not _differentiable(tensor) or \
            op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return reduce_tensors([tensor], op=op, compression=compression, prescale_factor=pre,
                              postscale_factor=post, kind=kind, name=name)[0]

    @tf.custom_gradient
    def _reduce(x):
        y = reduce_tensors([x], op=op, compression=compression, prescale_factor=pre, postscale_factor=post,
                           kind=kind, name=name)[0]

        def grad(dy):
            # Every rank's output depends on every rank's input with the same factor.
            return reduce_tensors([dy], op=op, compression=compression, prescale_factor=pre,
                                  postscale_factor=post, kind=kind + "_grad",
                                  name=None if name is None else name + "_grad")[0]

        return y, grad

    return _reduce(tensor)


@no_autograph
def allreduce(tensor, param_index: int = 0, num_params: int = 1, compression=Compression.none,
              op=ReduceOp.AVERAGE, *, average=None, device_dense: str = "", device_sparse: str = "",
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set=None, ignore_name_scope: bool = False):
    """Reduces `tensor` over all ranks and returns the result (same shape and dtype).

    `param_index`/`num_params` (SMDDP's bucketing hints) are accepted and not needed: the
    engine fuses whatever is ready. `op` defaults to AVERAGE; Horovod's `average=` still
    works. A `tf.IndexedSlices` is allgathered (values and indices), which represents the
    sum; for AVERAGE the values are divided by the world size. The shape must match on all
    ranks (a mismatch raises on every rank). `prescale_factor`/`postscale_factor` multiply
    before/after the reduction.
    """
    check_process_set(process_set)
    if op is ReduceOp.AVERAGE and average is not None:
        op = None  # the default op stands aside for an explicit legacy average=
    op = resolve_op(op, average)
    return _allreduce_one(_as_tensor(tensor), op, compression, prescale_factor, postscale_factor, "allreduce",
                          name)


@no_autograph
def oob_allreduce(tensor, compression=Compression.none, op=ReduceOp.AVERAGE, *, name: Optional[str] = None):
    """"Out of band" reduction of a tensor that is not a gradient (a loss, a metric): returns
    the reduced tensor."""
    op = resolve_op(op)
    return _allreduce_one(_as_tensor(tensor), op, compression, 1.0, 1.0, "oob_allreduce", name)


@no_autograph
def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=None, name: Optional[str] = None):
    """Reduces a list of tensors together (one fused hand-off); returns a list."""
    check_process_set(process_set)
    op = resolve_op(op, average)
    return reduce_tensors([_as_tensor(t) for t in tensors], op=op, compression=compression,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor, kind="grouped_allreduce",
                          name=name)


# ---- allgather, broadcast, alltoall, reducescatter ------------------------------------


@no_autograph
def _allgather_raw(x, name):
    base = op_name("allgather", name)
    scalar = x.shape.rank == 0

    def fn(a):
        return [core().allgather(a.reshape(1) if a.ndim == 0 else a, name=base)]

    out_shape = tf.TensorShape([None]) if scalar or x.shape.rank is None else \
        tf.TensorShape([None]).concatenate(x.shape[1:])
    return run_collective(fn, [x], [x.dtype], [out_shape], name="SmddpAllgather")[0]


@no_autograph
def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False, process_set=None,
              device: str = ""):
    """Concatenates every rank's tensor along the first dimension, in rank order. The first
    dimension may differ between ranks; the others must match. A scalar counts as shape [1]."""
    check_process_set(process_set)
    x = tf.convert_to_tensor(tensor)
    check_dtype(x)
    if not _differentiable(x):
        return _allgather_raw(x, name)

    @tf.custom_gradient
    def _gather(t):
        y = _allgather_raw(t, name)

        def grad(dy):
            # d(loss)/d(this rank's rows) = the sum over ranks of their gradients for those rows.
            rows = tf.reshape(tf.shape(t, out_type=tf.int64)[0] if t.shape.rank else tf.constant(1, tf.int64), [1])
            counts = _allgather_raw(rows, None if name is None else name + "_grad_rows")
            summed = reduce_tensors([dy], op=ReduceOp.SUM, kind="allgather_grad",
                                    name=None if name is None else name + "_grad")[0]
            start = tf.reduce_sum(counts[:rank()])
            part = summed[start:start + counts[rank()]]
            return tf.reshape(part, tf.shape(t))

        return y, grad

    return _gather(x)


@no_autograph
def _broadcast_raw(tensors, root: int, kind: str, name):
    base = op_name(kind, name)

    def fn(*arrays):
        c = core()
        works, outs = [], []
        try:
            for k, a in enumerate(arrays):
                out = empty_aligned(a.shape, a.dtype)
                if c.rank == root:
                    out[...] = a
                works.append(c.broadcast(out, root, name=f"{base}.{k}", async_op=True))
                outs.append(out)
        except BaseException:
            wait_all(works)
            raise
        wait_all(works)
        return outs

    return run_collective(fn, list(tensors), [t.dtype for t in tensors], [t.shape for t in tensors],
                          name="SmddpBroadcast")


@no_autograph
def broadcast(tensor, root_rank: int = 0, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set=None):
    """Returns `root_rank`'s value of `tensor` on every rank (shapes must match)."""
    check_process_set(process_set)
    root = _check_root(root_rank)
    x = tf.convert_to_tensor(tensor)
    check_dtype(x)
    if not _differentiable(x):
        return _broadcast_raw([x], root, "broadcast", name)[0]

    @tf.custom_gradient
    def _bcast(t):
        y = _broadcast_raw([t], root, "broadcast", name)[0]

        def grad(dy):
            summed = reduce_tensors([dy], op=ReduceOp.SUM, kind="broadcast_grad",
                                    name=None if name is None else name + "_grad")[0]
            return summed if rank() == root else tf.zeros_like(summed)

        return y, grad

    return _bcast(x)


@no_autograph
def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set=None):
    """Sends rows `splits[j]` of `tensor` (consecutive, along the first dimension) to rank j and
    returns `(received, received_splits)`: the rows from every rank in rank order and how many
    came from each. Without `splits` the first dimension is divided evenly."""
    check_process_set(process_set)
    x = tf.convert_to_tensor(tensor)
    check_dtype(x)
    if x.shape.rank == 0:
        raise ValueError("alltoall needs a tensor of rank >= 1")
    base = op_name("alltoall", name)
    inputs = [x]
    if splits is not None:
        inputs.append(tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64))

    def fn(a, s=None):
        received, counts = core().alltoall(a, None if s is None else [int(v) for v in s], name=base)
        return [received, np.asarray(counts, np.int32)]

    out_shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None
    received, counts = run_collective(fn, inputs, [x.dtype, tf.int32], [out_shape, tf.TensorShape([size()])],
                                      name="SmddpAlltoall")
    return received, counts


@no_autograph
def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=ReduceOp.AVERAGE,
                  name: Optional[str] = None, process_set=None, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduces `tensor` over all ranks and returns this rank's part of the result, split along
    the first dimension (the first `d0 % size` ranks get one extra row)."""
    check_process_set(process_set)
    op = resolve_op(op)
    x = tf.convert_to_tensor(tensor)
    check_dtype(x)
    if x.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor of rank >= 1")
    x, ctx = compression.compress(x)
    base = op_name("reducescatter", name)
    n, me = size(), rank()
    op_str = op.value
    pre, post = float(prescale_factor), float(postscale_factor)

    def fn(a):
        rows = [a.shape[0] // n + (1 if r < a.shape[0] % n else 0) for r in range(n)]
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        flat = a.reshape(-1)
        if pre != 1.0:
            flat = (flat * pre).astype(a.dtype)
        part = core().reduce_scatter(flat, op_str, counts=[r * row for r in rows], name=base)
        if post != 1.0:
            part = (part * post).astype(a.dtype)
        return [part.reshape((rows[me],) + a.shape[1:])]

    d0 = x.shape[0] if x.shape.rank is not None else None
    mine = None if d0 is None else d0 // n + (1 if me < d0 % n else 0)
    out_shape = None if x.shape.rank is None else tf.TensorShape([mine]).concatenate(x.shape[1:])
    out = run_collective(fn, [x], [x.dtype], [out_shape], name="SmddpReducescatter")[0]
    return compression.decompress(out, ctx)


# ---- variables ---------------------------------------------------------------------------


def _read(v):
    if isinstance(v, tf.Variable):
        return v.read_value() if not tf.executing_eagerly() else tf.convert_to_tensor(v)
    value = getattr(v, "value", None)  # a Keras 3 variable
    if value is not None and not callable(value):
        return tf.convert_to_tensor(value)
    return tf.convert_to_tensor(v)


@no_autograph
def broadcast_variables(variables, root_rank: int = 0, process_set=None, inplace=None):
    """Assigns `root_rank`'s values to `variables` on every rank (model variables, optimizer
    variables) in one hand-off. Returns None (eagerly and in tf.function) or, in a TF1 graph,
    the grouped assign op to run."""
    check_process_set(process_set)
    root = _check_root(root_rank)
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = [_read(v) for v in variables]
    for v, t in zip(variables, values):
        check_dtype(t, f"variable {getattr(v, 'name', v)!r}")
    outs = _broadcast_raw(values, root, "broadcast_variables", None)
    assigns = [v.assign(o) for v, o in zip(variables, outs)]
    if tf.executing_eagerly() or _in_function():
        return None  # in a tf.function the assignments run with the function (stateful ops)
    return tf.group(*[a for a in assigns if a is not None])


def _in_function() -> bool:
    return not tf.executing_eagerly() and tf.compat.v1.get_default_graph().building_function


@no_autograph
def broadcast_global_variables(root_rank: int = 0):
    """TF1 graph mode: an op that broadcasts all global variables from `root_rank`."""
    if tf.executing_eagerly() or _in_function():
        raise RuntimeError(
            "broadcast_global_variables() broadcasts TF1 global variables and works only in graph mode "
            "(tf.compat.v1.disable_eager_execution()); TensorFlow 2 has no global variables: call "
            "broadcast_variables(model.variables, root_rank) and broadcast_variables(optimizer.variables, "
            "root_rank) instead (or keras.callbacks.BroadcastGlobalVariablesCallback with model.fit)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# ---- small helpers -----------------------------------------------------------------------


@no_autograph
def overlap(tensor):
    """Marks a tensor whose reduction may overlap the backward pass; an identity here (the
    engine already overlaps whatever is submitted)."""
    if isinstance(tensor, tf.IndexedSlices):
        return tensor
    return tf.identity(tensor)


@no_autograph
def join(device: str = "") -> tf.Tensor:
    """Waits until every rank has called join() and returns the rank whose call came last (by
    wall clock). Minimal semantics: a barrier. Unlike Horovod, ranks that joined do not stand
    in with zeros for allreduces the others still run, so every rank must have finished its
    collectives (same number of steps) before joining."""
    base = op_name("join", None)

    def fn():
        times = core().allgather(np.array([time.time()], np.float64), name=base)
        return [np.array(int(np.argmax(times)), np.int32)]

    return run_collective(fn, [], [tf.int32], [tf.TensorShape([])], name="SmddpJoin")[0]


@no_autograph
def barrier(process_set=None):
    """Blocks until every rank reaches it (eager); in a graph, an op that does when it runs."""
    check_process_set(process_set)
    base = op_name("barrier", None)

    def fn():
        core().barrier(name=base)
        return []

    outs = run_collective(fn, [], [], [], name="SmddpBarrier")
    return None if tf.executing_eagerly() else outs[0].op


def broadcast_object(obj, root_rank: int = 0, session=None, name: Optional[str] = None, process_set=None):
    """Pickles `obj` on `root_rank` and returns it on every rank (eager Python)."""
    check_process_set(process_set)
    root = _check_root(root_rank)
    c = core()
    base = name or c._auto_name("tf.broadcast_object", None)
    data = np.frombuffer(pickle.dumps(obj), np.uint8).copy() if c.rank == root else None
    length = np.array([0 if data is None else data.size], np.int64)
    c.broadcast(length, root, name=base + ".len")
    buf = data if data is not None else np.empty(int(length[0]), np.uint8)
    c.broadcast(buf, root, name=base + ".data")
    return obj if c.rank == root else pickle.loads(buf.tobytes())


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None, process_set=None):
    """Horovod's helper: a function that broadcasts its argument from `root_rank`."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name: Optional[str] = None, process_set=None) -> list:
    """Pickles `obj` on every rank and returns the list of all ranks' objects, in rank order."""
    check_process_set(process_set)
    c = core()
    base = name or c._auto_name("tf.allgather_object", None)
    data = np.frombuffer(pickle.dumps(obj), np.uint8).copy()
    lengths = c.allgather(np.array([data.size], np.int64), name=base + ".len")
    gathered = c.allgather(data, name=base + ".data")
    out, offset = [], 0
    for n in lengths:
        out.append(pickle.loads(gathered[offset:offset + int(n)].tobytes()))
        offset += int(n)
    return out


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(size(), tf.int32)


def local_size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(core().local_size, tf.int32)


def rank_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(rank(), tf.int32)


def local_rank_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(core().local_rank, tf.int32)
