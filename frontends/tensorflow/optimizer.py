"""DistributedOptimizer (Keras 3 optimizers and TF1 `tf.compat.v1.train` optimizers) and the
TF1 BroadcastGlobalVariablesHook."""
from __future__ import annotations

import threading

import tensorflow as tf

from .compression import Compression
from .gradients import GradientReducer
from .ops import broadcast_global_variables
from .bridge import no_autograph
from .reduce_ops import ReduceOp

from .keras_flavour import is_keras2, keras as _active_keras, optimizer_base_classes


def _is_keras_optimizer(opt) -> bool:
    return isinstance(opt, optimizer_base_classes())


class _DistributedKerasOptimizer:
    """Mixed in front of a Keras 3 optimizer class: `apply` (which `apply_gradients` and
    `model.fit` call) reduces the gradients over all ranks first. With
    `backward_passes_per_step=N > 1` gradients are accumulated locally in optimizer
    variables and reduced and applied every N-th call only."""

    @no_autograph
    def build(self, variables):
        super().build(variables)
        if self._sdp_passes > 1:
            self._sdp_accumulators = [
                self.add_variable_from_reference(v, name="sdp_accumulated_gradient") for v in variables
            ]
            self._sdp_pass = self.add_variable(shape=(), initializer="zeros", dtype="int64",
                                               name="sdp_backward_pass")
        self.built = True

    @no_autograph
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if self._sdp_passes == 1:
            variables = trainable_variables
            if variables is None and self.built:
                variables = list(self._trainable_variables)
            return super().apply(self._sdp_reducer.reduce(grads, variables), trainable_variables)
        return self._sdp_accumulate_and_apply(grads, trainable_variables)

    @no_autograph
    def _sdp_accumulate_and_apply(self, grads, trainable_variables):
        if trainable_variables is None:
            if not self.built:
                raise ValueError("build the optimizer (optimizer.build(variables)) or pass the variables")
            trainable_variables = list(self._trainable_variables)
        if not self.built:
            with _active_keras().name_scope(self.name):
                self.build(trainable_variables)
        n = self._sdp_passes
        accs = [self._sdp_accumulators[self._get_variable_index(v)] for v in trainable_variables]
        for g, acc in zip(grads, accs):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._sdp_pass.assign_add(1)
        is_apply_step = tf.equal(tf.math.floormod(tf.convert_to_tensor(self._sdp_pass), n), 0)

        def apply_step():
            summed = [None if g is None else tf.convert_to_tensor(acc) for g, acc in zip(grads, accs)]
            if self._sdp_average_aggregated:
                summed = [None if s is None else s / tf.cast(n, s.dtype) for s in summed]
            super(_DistributedKerasOptimizer, self).apply(
                self._sdp_reducer.reduce(summed, trainable_variables), trainable_variables)
            for acc in accs:
                acc.assign(tf.zeros_like(tf.convert_to_tensor(acc)))
            return tf.constant(True)

        def local_step():
            # Keras counts every call, as with its own gradient_accumulation_steps.
            self._iterations.assign_add(1)
            return tf.constant(False)

        if tf.executing_eagerly():
            apply_step() if bool(is_apply_step) else local_step()
        else:
            tf.cond(is_apply_step, apply_step, local_step)


class _DistributedKeras2Optimizer:
    """Mixed in front of a Keras 2 (tf-keras) optimizer class: `apply_gradients` (which
    `minimize` and `model.fit` call) reduces the gradients over all ranks first."""

    @no_autograph
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        if not pairs:
            return super().apply_gradients(pairs, *args, **kwargs)
        grads, variables = zip(*pairs)
        reduced = self._sdp_reducer.reduce(list(grads), list(variables))
        return super().apply_gradients(list(zip(reduced, variables)), *args, **kwargs)


_keras_classes = {}
_keras_lock = threading.Lock()


def _keras_class(base):
    mixin = _DistributedKeras2Optimizer if is_keras2() else _DistributedKerasOptimizer
    with _keras_lock:
        cls = _keras_classes.get(base)
        if cls is None:
            cls = type(base.__name__, (mixin, base),
                       {"__module__": base.__module__, "__doc__": f"{base.__name__}, reducing gradients over "
                        "all ranks before applying them (smdistributed.dataparallel)."})
            _keras_classes[base] = cls
        return cls


if hasattr(tf.compat.v1.train, "Optimizer"):

    class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
        """A TF1 `tf.compat.v1.train.Optimizer` whose compute_gradients() returns reduced
        gradients (graph mode; `minimize` goes through it)."""

        def __init__(self, optimizer, name=None, use_locking=False, reducer=None):
            super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
            self._optimizer = optimizer
            self._reducer = reducer

        def compute_gradients(self, *args, **kwargs):
            pairs = self._optimizer.compute_gradients(*args, **kwargs)
            if not pairs:
                return pairs
            grads, variables = zip(*pairs)
            return list(zip(self._reducer.reduce(list(grads), list(variables)), variables))

        def apply_gradients(self, *args, **kwargs):
            return self._optimizer.apply_gradients(*args, **kwargs)

        def get_slot(self, *args, **kwargs):
            return self._optimizer.get_slot(*args, **kwargs)

        def get_slot_names(self, *args, **kwargs):
            return self._optimizer.get_slot_names(*args, **kwargs)

        def variables(self, *args, **kwargs):
            return self._optimizer.variables(*args, **kwargs)
else:  # pragma: no cover
    _LegacyDistributedOptimizer = None


def _has_state(optimizer) -> bool:
    """Keras 2 optimizers: whether slot variables exist already (the optimizer was used)."""
    try:
        return len(list(optimizer.variables())) > 1
    except Exception:  # noqa: BLE001
        return False


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False, op=ReduceOp.AVERAGE,
                         bucket_cap_mb=None, backward_passes_per_step=1, average_aggregated_gradients=False,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=None,
                         scale_local_gradients=True):
    """Wraps an optimizer so that gradients are reduced over all ranks before they are applied.

    Keras 3 optimizers (`tf.optimizers.*`, `keras.optimizers.*`, what TF 2.16+ ships): returns
    a new optimizer of a subclass of the same class built from `optimizer.get_config()` (wrap
    before training: state of an already used optimizer is not carried over), whose
    `apply_gradients`/`apply` reduce first; it works under `model.fit` and in custom loops,
    eagerly and in `tf.function`. TF1 `tf.compat.v1.train.Optimizer`s: a wrapper whose
    `compute_gradients` (and so `minimize`) reduce.

    `backward_passes_per_step=N`: gradients are accumulated locally and reduced and applied
    every N-th call (summed, or averaged over the N passes with
    `average_aggregated_gradients=True`). `bucket_cap_mb`: gradients smaller than this are
    packed into buckets of up to this size per dtype, one engine operation per bucket
    (larger gradients go alone).
    `use_locking`, `device_dense`, `device_sparse`, `num_groups`, `groups` are accepted and
    not needed.
    """
    backward_passes_per_step = int(backward_passes_per_step)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    reducer = GradientReducer(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                              gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                              scale_local_gradients=scale_local_gradients, kind="optimizer_gradients",
                              bucket_bytes=int(float(bucket_cap_mb) * (1 << 20)) if bucket_cap_mb else None)
    if isinstance(optimizer, (_DistributedKerasOptimizer, _DistributedKeras2Optimizer)):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if _is_keras_optimizer(optimizer):
        if is_keras2() and backward_passes_per_step != 1:
            raise NotImplementedError("backward_passes_per_step > 1 is implemented for Keras 3 optimizers only; "
                                      "with Keras 2 (tf-keras) accumulate gradients in the training loop")
        if getattr(optimizer, "built", False) or (is_keras2() and getattr(optimizer, "iterations", None) is not None
                                                   and _has_state(optimizer)):
            raise ValueError("wrap the optimizer in DistributedOptimizer before it is used (it already has "
                             "variables, which the distributed copy would not carry over)")
        config = optimizer.get_config()
        if name is not None:
            config["name"] = name
        dist = _keras_class(type(optimizer)).from_config(config)
        dist._sdp_reducer = reducer
        dist._sdp_passes = backward_passes_per_step
        dist._sdp_average_aggregated = bool(average_aggregated_gradients)
        return dist
    if _LegacyDistributedOptimizer is not None and isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise NotImplementedError("backward_passes_per_step > 1 is implemented for Keras optimizers only")
        return _LegacyDistributedOptimizer(optimizer, name=name, use_locking=use_locking, reducer=reducer)
    raise TypeError(f"DistributedOptimizer wraps a Keras optimizer (tf.optimizers.*, keras.optimizers.*) or a "
                    f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 SessionRunHook (tf.compat.v1.train.MonitoredTrainingSession) that broadcasts all
    global variables from `root_rank` once the session is created. TensorFlow 2.21 has no
    estimator API and runs eagerly: creating the hook there raises a RuntimeError that says
    what to use instead."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        if tf.executing_eagerly():
            raise RuntimeError(
                "BroadcastGlobalVariablesHook is a TF1 SessionRunHook (tf.estimator / MonitoredTrainingSession "
                "in graph mode); TensorFlow 2.21 has no estimator API and runs eagerly. Call "
                "broadcast_variables(model.variables, root_rank) and broadcast_variables(optimizer.variables, "
                "root_rank) after the first step, or use "
                "smdistributed.dataparallel.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback with "
                "model.fit")
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
