"""Gradient reduction of the older DistributedDataParallel for models on a GPU: the wrapper's
side of gpu_buckets.py.

The wrapper gets its own NCCL communicator (its stream and SM budget are its own, not the
process group's), starts every rank from rank 0's parameters and buffers through it, and
tells the buckets when gradients are ready: per parameter when reductions overlap backward,
or once, at backward's end, through a hook on the forward's outputs.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.utils._pytree  # noqa: F401  (tree_leaves over a forward's outputs)

from ..cuda_collectives import CudaCollectives
from .gpu_buckets import GpuGradientBuckets


class GpuStrategy:
    def __init__(self, pg, prefix: str, params: Dict[str, torch.nn.Parameter], tensors: List[torch.Tensor],
                 bucket_cap_bytes: int, reduce_dtype: Optional[torch.dtype], overlap: Optional[bool],
                 max_ctas: Optional[int]):
        self.syncing = True  # False inside the wrapper's no_sync()
        if overlap is None:
            overlap = pg._engine.num_hosts > 1  # see gpu_buckets.py for why
        self._gpu = CudaCollectives(pg._store, pg.rank(), pg.size(), tensors[0].device, pg.gpu_timeout_s(),
                                    key=f"smddp/nccl/{prefix}", max_ctas=max_ctas)
        with torch.no_grad():
            self._gpu.broadcast([t.data for t in tensors], 0).wait()
        self.buckets = GpuGradientBuckets(params, self._gpu, bucket_cap_bytes, reduce_dtype, overlap)
        self._callback_queued = False
        if overlap:
            for p in params.values():
                p.register_post_accumulate_grad_hook(self._hook)

    @property
    def bucket_sizes(self) -> List[int]:
        return self.buckets.bucket_sizes

    def broadcast_buffers(self, buffers: Dict[str, torch.Tensor]) -> None:
        self._gpu.broadcast([b.data for b in buffers.values()], 0).wait()

    def _hook(self, param: torch.Tensor) -> None:
        if not self.syncing:
            return
        self._queue_finish()
        self.buckets.gradient_ready(param)

    def _queue_finish(self, *_):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def watch_outputs(self, output):
        """Reducing after backward: a hook on the outputs (called as backward starts) queues the
        reduction for backward's end; no hook runs per parameter."""
        if self.buckets.overlap:
            return output
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._queue_finish)
        return output

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self.buckets.finish()
