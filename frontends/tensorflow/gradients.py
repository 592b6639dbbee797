"""The gradient reduction shared by DistributedGradientTape and DistributedOptimizer.

One step's gradients reach the engine together: one hand-off (one `tf.numpy_function` op in
a graph) packs the dense gradients into buckets (25 MB by default, `bucket_cap_mb` of
DistributedOptimizer), submits every bucket's allreduce without waiting, then waits for all.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from .compression import Compression
from .consistency import reduction_guard
from .ops import reduce_tensors
from .bridge import no_autograph
from .reduce_ops import ReduceOp, resolve_op
from .runtime import check_process_set, size


class GradientReducer:
    """Options of one wrapper (tape or optimizer) and the reduction they imply."""

    def __init__(self, *, op=ReduceOp.AVERAGE, compression=Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, process_set=None, scale_local_gradients: bool = True,
                 kind: str = "gradients", bucket_bytes: Optional[int] = None):
        check_process_set(process_set)
        self.op = resolve_op(op)
        self.compression = compression or Compression.none
        self.sparse_as_dense = bool(sparse_as_dense)
        self.scale_local_gradients = scale_local_gradients
        self.kind = kind
        self.bucket_bytes = bucket_bytes
        f = float(gradient_predivide_factor)
        if f != 1.0 and self.op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor applies only to op=ReduceOp.AVERAGE")
        # Horovod's split of the average: divide by f before the sum, by size/f after it.
        self.prescale, self.postscale = (1.0 / f, f) if f != 1.0 else (1.0, 1.0)
        self._local_sources = set()

    def register_local_source(self, variable) -> None:
        """Gradients of `variable` stay local (not reduced); see DistributedGradientTape."""
        self._local_sources.add(variable.ref() if hasattr(variable, "ref") else id(variable))

    def _is_local(self, variable) -> bool:
        if not self._local_sources or variable is None:
            return False
        try:
            key = variable.ref() if hasattr(variable, "ref") else id(variable)
        except TypeError:
            key = id(variable)
        return key in self._local_sources

    @no_autograph
    def reduce(self, grads: Sequence, variables: Optional[Sequence] = None) -> List:
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        local = [self._is_local(v) for v in variables]
        shared = [None if (g is None or is_local) else g for g, is_local in zip(grads, local)]
        if size() == 1:
            reduced = [self._single_process(g) for g in shared]
        else:
            # Once, at the second reduction: every rank must hold the same variables (a
            # missing broadcast otherwise trains a different model per rank, silently).
            where = {"gradients": "DistributedGradientTape", "optimizer_gradients": "DistributedOptimizer"}
            guard = reduction_guard([v for v, g in zip(variables, shared) if g is not None],
                                    f"{where.get(self.kind, self.kind)}, at the second step")
            with tf.control_dependencies([guard] if guard is not None else []):
                reduced = reduce_tensors(shared, op=self.op, compression=self.compression,
                                         sparse_as_dense=self.sparse_as_dense, prescale_factor=self.prescale,
                                         postscale_factor=self.postscale, kind=self.kind,
                                         bucket_bytes=self.bucket_bytes)
        out = []
        for g, r, is_local in zip(grads, reduced, local):
            if is_local and g is not None:
                # Horovod's convention: local gradients are scaled as if averaged.
                if self.scale_local_gradients and self.op is ReduceOp.AVERAGE and size() > 1:
                    g = _scale(g, 1.0 / size())
                out.append(g)
            else:
                out.append(r)
        return out

    def _single_process(self, g):
        if g is None:
            return None
        if isinstance(g, tf.IndexedSlices) and self.sparse_as_dense:
            g = tf.convert_to_tensor(g)
        return g  # prescale * postscale == 1 by construction


def _scale(g, factor: float):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)
