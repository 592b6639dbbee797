"""smdistributed.dataparallel.tensorflow.keras: the Keras (3) side of the TensorFlow frontend.

    import smdistributed.dataparallel.tensorflow.keras as sdp   # or `as hvd`
    sdp.init()
    opt = sdp.DistributedOptimizer(tf.optimizers.Adam(0.001 * sdp.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[sdp.callbacks.BroadcastGlobalVariablesCallback(0),
                               sdp.callbacks.MetricAverageCallback(),
                               sdp.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * sdp.size(),
                                                                        warmup_epochs=3)])
"""
import tensorflow as tf

from .. import ops as _ops
from .. import optimizer as _optimizer
from ..compression import Compression
from ..reduce_ops import ReduceOp
from ..runtime import (AlreadyInitializedError, NotInitializedError, cross_rank, cross_size, init, is_homogeneous,
                       is_initialized, local_rank, local_size, rank, shutdown, size)
from . import callbacks

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=ReduceOp.AVERAGE, backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None, scale_local_gradients=True, bucket_cap_mb=None):
    """A Keras optimizer whose gradients are reduced over all ranks before they are applied
    (Horovod's keras argument order). See smdistributed.dataparallel.tensorflow.DistributedOptimizer."""
    return _optimizer.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, op=op, bucket_cap_mb=bucket_cap_mb,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)


def broadcast_global_variables(root_rank=0):
    """Keras 3 keeps no global variables: use callbacks.BroadcastGlobalVariablesCallback or
    broadcast_variables(model.variables, root_rank)."""
    raise RuntimeError("broadcast_global_variables() needs TF1 global variables, which Keras 3 does not have: "
                       "use smdistributed.dataparallel.tensorflow.keras.callbacks."
                       "BroadcastGlobalVariablesCallback(root_rank) with model.fit, or "
                       "broadcast_variables(model.variables, root_rank)")


def broadcast_variables(variables, root_rank=0):
    return _ops.broadcast_variables(variables, root_rank)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduces a tensor-compatible value over all ranks (default: average) and returns a tensor."""
    return _ops.allreduce(tf.convert_to_tensor(value), compression=compression, op=op, average=average,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name)


def allgather(value, name=None):
    return _ops.allgather(tf.convert_to_tensor(value), name=name)


def broadcast(value, root_rank=0, name=None):
    return _ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value, name=None, op=ReduceOp.AVERAGE):
    return _ops.reducescatter(tf.convert_to_tensor(value), name=name, op=op)


broadcast_object = _ops.broadcast_object
allgather_object = _ops.allgather_object
