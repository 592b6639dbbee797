"""smdistributed.dataparallel.torch: the PyTorch frontend.

    import smdistributed.dataparallel.torch.torch_smddp   # registers the "smddp" backend
    torch.distributed.init_process_group(backend="smddp")

The older API lives in `.distributed` and `.parallel` (deprecated, still working). The
package itself is Horovod's PyTorch API (`import smdistributed.dataparallel.torch as hvd`,
see `horovod.py`).
"""
from .horovod import (Adasum, Average, Compression, DistributedOptimizer, Max, Min, ProcessSet, Product, Sum,
                      SyncBatchNorm, allgather, allgather_async, allgather_object, allreduce, allreduce_,
                      allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, broadcast_object, broadcast_optimizer_state,
                      broadcast_parameters, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                      global_process_set, gloo_built, gloo_enabled, grouped_allgather, grouped_allreduce,
                      grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, init, is_homogeneous,
                      is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                      nccl_built, poll, rank, reducescatter, reducescatter_async, rocm_built, shutdown, size,
                      synchronize)
