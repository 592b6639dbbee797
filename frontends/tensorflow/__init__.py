"""smdistributed.dataparallel.tensorflow: data-parallel TensorFlow 2 training.

    import smdistributed.dataparallel.tensorflow as sdp
    sdp.init()
    ...
    tape = sdp.DistributedGradientTape(tape)            # inside or outside tf.function
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    sdp.broadcast_variables(model.variables, root_rank=0)   # after the first step
    sdp.broadcast_variables(opt.variables(), root_rank=0)

The SMDDP API plus Horovod's TensorFlow API (`import smdistributed.dataparallel.tensorflow
as hvd` runs Horovod scripts). Collectives run in this project's native engine on host
memory; inside `tf.function` they are `tf.numpy_function` ops (not XLA-compilable). This
package does not import torch.
"""
from .compression import Compression, Compressor, FP16Compressor, NoneCompressor
from .ops import (allgather, allgather_object, allreduce, alltoall, barrier, broadcast, broadcast_global_variables,
                  broadcast_object, broadcast_object_fn, broadcast_variables, grouped_allreduce, join, local_rank_op,
                  local_size_op, oob_allreduce, overlap, rank_op, reducescatter, size_op)
from .optimizer import BroadcastGlobalVariablesHook, DistributedOptimizer
from .reduce_ops import ReduceOp
from .runtime import (AlreadyInitializedError, NotInitializedError, ProcessSet, SmddpError, add_process_set,
                      cross_rank, cross_size, global_process_set, init, is_homogeneous, is_initialized, local_rank,
                      local_size, rank, remove_process_set, shutdown, size)
from .tape import DistributedGradientTape

# Horovod's names for the reduce ops.
Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM  # accepted by name; using it raises NotImplementedError


def mpi_threads_supported() -> bool:
    """Horovod: whether MPI may be used from several threads. No MPI here."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise RuntimeError("the timeline is configured at startup: set SMDDP_TIMELINE=<file> in the "
                       "environment before init() (smddprun --help lists the variables)")


def stop_timeline() -> None:
    raise RuntimeError("the timeline is configured at startup with SMDDP_TIMELINE")


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "rank", "local_rank", "cross_rank", "cross_size",
    "is_homogeneous", "allreduce", "oob_allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
    "reducescatter", "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "overlap", "join", "barrier", "DistributedGradientTape", "DistributedOptimizer",
    "BroadcastGlobalVariablesHook", "Compression", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "size_op", "local_size_op", "rank_op", "local_rank_op", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "SmddpError", "NotInitializedError", "AlreadyInitializedError",
]
