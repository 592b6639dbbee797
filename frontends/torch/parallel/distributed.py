"""The older `smdistributed.dataparallel.torch.parallel.DistributedDataParallel`.

Unlike torch's DDP it hands gradients straight to this library's reductions while backward
runs, by one of two strategies chosen from where the model lives:
- on the CPU (cpu_strategy.py): gradients packed into buckets of `bucket_cap_mb` and
  averaged by the process group's engine on its own thread, matched across ranks by name;
- on a GPU (gpu_strategy.py, gpu_buckets.py): gradients packed into flat GPU buckets and
  averaged by NCCL on the wrapper's own communicator.
Both plan their buckets with the shared planner (smdistributed.common.bucket_plan). Neither
changes the process group's own settings: its engine's fusion threshold is the group's, for
every user of the group.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from smdistributed.common.config import default_bucket_bytes

from ..deprecation import warn_once
from ..process_group import smddp_group
from ..tensors import on_cuda
from .cpu_strategy import CpuStrategy
from .gpu_strategy import GpuStrategy

_instances = itertools.count()  # wrappers are created in the same order on every rank


def _smddp_group(process_group):
    if not dist.is_initialized():
        raise RuntimeError("DistributedDataParallel: call init_process_group() (backend smddp) before wrapping")
    try:
        return smddp_group(process_group)
    except RuntimeError as e:
        raise RuntimeError(f"smdistributed DistributedDataParallel needs a process group of the smddp backend: {e}") \
            from None


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=None, reduce_dtype: Optional[torch.dtype] = None,
                 overlap_communication: Optional[bool] = None, nccl_max_ctas: Optional[int] = None):
        """`reduce_dtype`, `overlap_communication` and `nccl_max_ctas` (GPU models only) are this
        library's additions: gradients of floating types travel in `reduce_dtype` (bfloat16
        halves the bytes); buckets are reduced during backward when `overlap_communication`,
        else all at once after it (default: overlap only when the group spans hosts, see
        gpu_buckets.py); one reduction occupies at most `nccl_max_ctas` SMs."""
        super().__init__()
        warn_once("parallel.DistributedDataParallel", "torch.nn.parallel.DistributedDataParallel")
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        prefix = f"smddp.ddp{next(_instances)}"
        pg = _smddp_group(process_group)
        cap_mb = default_bucket_bytes() / (1 << 20) if bucket_cap_mb is None else bucket_cap_mb
        cap = int(cap_mb * 1024 * 1024)
        params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        tensors = list(module.parameters()) + list(module.buffers())
        if on_cuda(tensors, "DistributedDataParallel"):
            self._strategy = GpuStrategy(pg, prefix, params, tensors, cap, reduce_dtype, overlap_communication,
                                         nccl_max_ctas)
        else:
            self._strategy = CpuStrategy(module, params, pg._engine, prefix, cap)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces them."""
        previous, self._strategy.syncing = self._strategy.syncing, False
        try:
            yield
        finally:
            self._strategy.syncing = previous

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers:
            buffers = dict(self.module.named_buffers())
            if buffers:
                with torch.no_grad():
                    self._strategy.broadcast_buffers(buffers)
        output = self.module(*inputs, **kwargs)
        if self._strategy.syncing and torch.is_grad_enabled():
            output = self._strategy.watch_outputs(output)
        return output
