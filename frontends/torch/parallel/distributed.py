"""The older `smdistributed.dataparallel.torch.parallel.DistributedDataParallel`.

Unlike torch's DDP it hands gradients straight to the native engine: a hook on every
parameter enqueues that gradient's averaging allreduce, by parameter name, the moment
autograd has accumulated it. The engine fuses whatever is ready on every rank into
buckets of `bucket_cap_mb` and reduces them on its own thread while backward goes on;
at the end of backward the wrapper waits for the last of them, so the optimizer sees
averaged gradients. Matching by name means ranks need not produce gradients in the same
order, and a parameter a rank did not use this step is reduced as zeros.

A model on a GPU takes the NCCL path instead (gpu_buckets.py): gradients are views into
flat GPU buckets, reduced in a fixed bucket order on the group's stream as backward runs.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree  # noqa: F401  (tree_leaves over a forward's outputs)

from smdistributed import _core
from smdistributed.common.config import default_bucket_bytes

from ..deprecation import warn_once
from ..cuda_collectives import CudaCollectives
from ..process_group import smddp_group
from ..tensors import check_tensor, core_dtype, on_cuda
from .gpu_buckets import GpuGradientBuckets

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
        self._prefix = f"smddp.ddp{next(_instances)}"
        self._pg = _smddp_group(process_group)
        self._engine = self._pg._engine
        cap = default_bucket_bytes() / (1 << 20) if bucket_cap_mb is None else bucket_cap_mb
        self._engine.fusion_threshold = int(cap * 1024 * 1024)
        self._params: Dict[str, torch.nn.Parameter] = {
            n: p for n, p in module.named_parameters() if p.requires_grad
        }
        self._gpu_buckets = None
        self._require_sync = True
        self._in_flight: List[int] = []
        self._reduced = set()  # names reduced during the current backward
        self._callback_queued = False
        tensors = list(module.parameters()) + list(module.buffers())
        if on_cuda(tensors, "DistributedDataParallel"):
            if overlap_communication is None:
                overlap_communication = self._engine.num_hosts > 1
            self._init_gpu(tensors, cap, reduce_dtype, overlap_communication, nccl_max_ctas)
            return
        for name, p in self._params.items():
            check_tensor(p, f"DistributedDataParallel parameter '{name}'")
        self._sync_module_states()
        for name, p in self._params.items():
            p.register_post_accumulate_grad_hook(self._make_hook(name))

    def _init_gpu(self, tensors, cap_mb, reduce_dtype, overlap, max_ctas) -> None:
        device = tensors[0].device
        # Its own communicator: its stream and SM budget are the wrapper's, not the group's.
        self._gpu = CudaCollectives(self._pg._store, self._pg.rank(), self._pg.size(), device,
                                    self._pg.gpu_timeout_s(), key=f"smddp/nccl/{self._prefix}", max_ctas=max_ctas)
        with torch.no_grad():
            self._gpu.broadcast([t.data for t in tensors], 0).wait()
        self._gpu_buckets = GpuGradientBuckets(self._params, self._gpu, int(cap_mb * 1024 * 1024), reduce_dtype,
                                               overlap)
        if overlap:
            for p in self._params.values():
                p.register_post_accumulate_grad_hook(self._gpu_hook)

    def _gpu_hook(self, param: torch.Tensor) -> None:
        if not self._require_sync:
            return
        self._queue_gpu_finish()
        self._gpu_buckets.gradient_ready(param)

    def _queue_gpu_finish(self, *_):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_gpu_backward)

    def _watch_outputs(self, output):
        """Reducing after backward: a hook on the outputs (called as backward starts) queues the
        reduction for backward's end; no hook runs per parameter."""
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._queue_gpu_finish)
        return output

    def _finish_gpu_backward(self) -> None:
        self._callback_queued = False
        self._gpu_buckets.finish()

    # -- helpers ------------------------------------------------------------------------------
    def _submit(self, op, name: str, t: torch.Tensor, **kw) -> int:
        return self._engine.submit(op=op, name=name, in_ptr=t.data_ptr(), out_ptr=t.data_ptr(), count=t.numel(),
                                   out_capacity=t.numel() * t.element_size(), dtype=core_dtype(t),
                                   shape=list(t.shape), **kw)

    def _broadcast_all(self, prefix: str, tensors: Dict[str, torch.Tensor]) -> None:
        handles = []
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise RuntimeError(f"DistributedDataParallel: '{name}' is not contiguous")
            handles.append(self._submit(_core.OpType.BROADCAST, f"{prefix}.{name}", t.data, root=0))
        for h in handles:
            self._engine.wait(h, -1.0)

    def _sync_module_states(self) -> None:
        # Every rank starts from rank 0's parameters and buffers.
        with torch.no_grad():
            self._broadcast_all(f"{self._prefix}.param", dict(self.module.named_parameters()))
            self._broadcast_all(f"{self._prefix}.buffer", dict(self.module.named_buffers()))

    # -- gradient reduction ----------------------------------------------------------------
    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if not self._require_sync:
                return
            self._queue_final_callback()
            self._reduced.add(name)
            self._in_flight.append(
                self._submit(_core.OpType.ALLREDUCE, f"{self._prefix}.grad.{name}", param.grad,
                             reduce_op=_core.ReduceOp.AVERAGE))

        return hook

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        # Parameters this rank did not use still take part, as zeros, so every rank's
        # engine sees the same names.
        for name, p in self._params.items():
            if name not in self._reduced:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._in_flight.append(
                    self._submit(_core.OpType.ALLREDUCE, f"{self._prefix}.grad.{name}", p.grad,
                                 reduce_op=_core.ReduceOp.AVERAGE))
        handles, self._in_flight = self._in_flight, []
        self._reduced = set()
        self._callback_queued = False
        for h in handles:
            self._engine.wait(h, -1.0)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- forward ------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers:
            buffers = dict(self.module.named_buffers())
            if buffers:
                with torch.no_grad():
                    if self._gpu_buckets is not None:
                        self._gpu.broadcast([b.data for b in buffers.values()], 0).wait()
                    else:
                        self._broadcast_all(f"{self._prefix}.buffer", buffers)
        output = self.module(*inputs, **kwargs)
        if (self._gpu_buckets is not None and not self._gpu_buckets.overlap and self._require_sync
                and torch.is_grad_enabled()):
            output = self._watch_outputs(output)
        return output
