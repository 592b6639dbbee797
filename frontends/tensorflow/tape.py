"""DistributedGradientTape: a tf.GradientTape whose gradient() returns globally reduced gradients."""
from __future__ import annotations

import threading

import tensorflow as tf

from .compression import Compression
from .gradients import GradientReducer
from .bridge import no_autograph
from .reduce_ops import ReduceOp

_classes = {}
_classes_lock = threading.Lock()


def _tape_class(base):
    """DistributedGradientTape combined with a user's GradientTape subclass (its gradient()
    then runs under ours)."""
    with _classes_lock:
        cls = _classes.get(base)
        if cls is None:
            cls = type(f"Distributed{base.__name__}", (DistributedGradientTape, base), {})
            _classes[base] = cls
        return cls


class DistributedGradientTape(tf.GradientTape):
    """Wraps a `tf.GradientTape` (usually after its `with` block has recorded the forward pass):

        with tf.GradientTape() as tape:
            loss = ...
        tape = sdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)   # averaged over all ranks

    Works eagerly and inside `tf.function`. All of one call's dense gradients are handed to
    the engine at once (one op in a graph) and fused there. `tf.IndexedSlices` gradients
    (embeddings) are allgathered, or densified and allreduced with `sparse_as_dense=True`.
    `device_dense`/`device_sparse` are accepted for compatibility (reductions run in host
    memory). Horovod's extra arguments: `gradient_predivide_factor` (AVERAGE only: divide
    by f before the sum and by size/f after it), `num_groups`/`groups` (accepted; the engine
    fuses by size), `process_set` (only the global one), `scale_local_gradients` (see
    `register_local_source`).
    """

    def __new__(cls, gradtape=None, *args, **kwargs):
        base = type(gradtape)
        if cls is DistributedGradientTape and isinstance(gradtape, tf.GradientTape) and \
                base is not tf.GradientTape and not issubclass(base, DistributedGradientTape):
            cls = _tape_class(base)
        return super().__new__(cls)

    def __init__(self, gradtape, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                 sparse_as_dense: bool = False, op=ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups=None, process_set=None, scale_local_gradients: bool = True):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        # Take over the recorded tape's state (not a copy of what it recorded: the same tape).
        self.__dict__.update(gradtape.__dict__)
        self._sdp_reducer = GradientReducer(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                            gradient_predivide_factor=gradient_predivide_factor,
                                            process_set=process_set, scale_local_gradients=scale_local_gradients,
                                            kind="gradients")

    def register_local_source(self, source) -> None:
        """Marks a variable whose gradient is not reduced (a per-rank local variable)."""
        self._sdp_reducer.register_local_source(source)

    @no_autograph
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        if len(flat_sources) != len(flat_grads):
            flat_sources = [None] * len(flat_grads)
        reduced = self._sdp_reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)
