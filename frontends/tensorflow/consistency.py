"""Once per training loop, every rank must hold the same trainable variables.

Data parallelism only works if every rank starts from the same weights; averaged gradients
then keep them equal. A forgotten or too-early broadcast (a Keras model built lazily by its
first batch has no weights to broadcast at `on_train_begin`) lets ranks train different
models with no error at all. So once, at the second gradient reduction of each tape or
optimizer (after the first step and after the broadcast that scripts make after it), and
after the second batch of `model.fit` with the broadcast callback, each rank takes a CRC-32
of every variable's bytes, the ranks gather them, and all raise, naming the first variable
that differs and the ranks that hold another value, if they do not agree.

Cost: one pass over the variables once per loop; in a `tf.function`, one Python call per
step to learn whether this is the checking step. `SMDDP_CONSISTENCY_CHECK=0` turns it off.
"""
from __future__ import annotations

import itertools
import os
import zlib
from typing import Sequence

import numpy as np
import tensorflow as tf

from .runtime import SmddpError, core, size

CHECK_AT_REDUCTION = 2  # the first reduction precedes the usual broadcast; the second follows it
_check_ids = itertools.count()  # checks happen in the same order on every rank


def enabled() -> bool:
    return os.environ.get("SMDDP_CONSISTENCY_CHECK", "1") != "0" and size() > 1


def is_variable(v) -> bool:
    """A tf.Variable or a Keras 3 variable (which wraps one)."""
    return isinstance(v, tf.Variable) or (hasattr(v, "assign") and hasattr(v, "trainable"))


def variable_name(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or v)


def _value(v) -> np.ndarray:
    value = getattr(v, "value", None)  # a Keras 3 variable's tf.Variable
    t = value if value is not None and not callable(value) else v
    return np.asarray(tf.convert_to_tensor(t))


def _graph_read(v) -> tf.Tensor:
    if isinstance(v, tf.Variable):
        return v.read_value()
    return tf.convert_to_tensor(v.value)  # a Keras 3 variable


def _checksums(arrays: Sequence[np.ndarray]) -> np.ndarray:
    sums = [zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) for a in arrays]
    return np.array(sums, np.int64)


def check_arrays(names: Sequence[str], arrays: Sequence[np.ndarray], where: str) -> None:
    """Raises SmddpError on every rank unless every rank's `arrays` are bitwise equal."""
    c = core()
    sums = _checksums(arrays)
    gathered = c.allgather(np.concatenate([[len(sums)], sums]).astype(np.int64),
                           name=f"tf.consistency.{next(_check_ids)}")
    records, pos = [], 0  # each rank's [n, crc_1 .. crc_n]
    for _ in range(c.size):
        n = int(gathered[pos])
        records.append(gathered[pos + 1:pos + 1 + n])
        pos += 1 + n
    counts = [len(r) for r in records]
    if len(set(counts)) > 1:
        raise SmddpError(f"{where}: the ranks check different numbers of variables ({counts}, by rank): they do "
                         "not train the same model")
    table = np.stack(records)  # ranks x variables
    differs = np.flatnonzero((table != table[0]).any(axis=0))
    if differs.size:
        i = int(differs[0])
        others = [r for r in range(c.size) if table[r, i] != table[0, i]]
        raise SmddpError(
            f"{where}: ranks hold different values of variable '{names[i]}' (shape {list(arrays[i].shape)}): "
            f"ranks {others} differ from rank 0 ({differs.size} of {len(names)} variables differ). Every rank must "
            "start from the same weights: broadcast them from one rank (BroadcastGlobalVariablesCallback(0) "
            "among model.fit's callbacks, or broadcast_variables(model.variables, root_rank=0) and "
            "broadcast_variables(optimizer.variables, root_rank=0) after the first step). "
            "SMDDP_CONSISTENCY_CHECK=0 skips this check")


def check_variables(variables: Sequence, where: str) -> None:
    """Eager: compares `variables` across ranks now."""
    variables = list(variables)
    check_arrays([variable_name(v) for v in variables], [_value(v) for v in variables], where)


# Reductions seen per set of variables. A script wraps its tape anew at every step, so the
# count cannot live in the wrapper. The key must be the same on every rank, or ranks would check
# at different reductions and wait on each other: names, shapes and dtypes, which the same code
# produces on every rank (object ids are reused after garbage collection, differently per rank).
_reductions = {}


def _key(variables) -> tuple:
    return tuple((variable_name(v), tuple(getattr(v, "shape", ())), str(getattr(v, "dtype", "")))
                 for v in variables)


def _due(key) -> bool:
    n = _reductions.get(key, 0) + 1
    _reductions[key] = n
    return n == CHECK_AT_REDUCTION


def reduction_guard(variables: Sequence, where: str):
    """Counts a reduction of the gradients of `variables`; at the second one, checks that every
    rank holds the same values. Eagerly the check runs now (returns None); in a graph this
    returns an op that checks when due, on which the reduction must depend (so the check reads
    the variables before this step updates them)."""
    variables = [v for v in variables if is_variable(v)]
    if not variables or not enabled():
        return None
    key = _key(variables)
    if tf.executing_eagerly():
        if _due(key):
            check_variables(variables, where)
        return None
    names = [variable_name(v) for v in variables]

    def due():
        return np.bool_(_due(key))

    flag = tf.numpy_function(due, [], tf.bool, stateful=True, name="SmddpConsistencyDue")
    flag.set_shape([])

    def check(*arrays):
        check_arrays(names, [np.asarray(a) for a in arrays], where)
        return np.zeros((), np.int8)

    def run_check():
        out = tf.numpy_function(check, [_graph_read(v) for v in variables], tf.int8, stateful=True,
                                name="SmddpConsistencyCheck")
        out.set_shape([])
        return out

    return tf.cond(flag, run_check, lambda: tf.zeros((), tf.int8))
