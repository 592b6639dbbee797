"""Gradient reduction of the older DistributedDataParallel for models on a GPU.

Parameters are grouped into flat GPU buckets. A bucket is reduced by packing its gradients
with one multi-tensor copy, one NCCL call on the packed buffer, and one multi-tensor copy
back into the gradients: a constant number of host calls per bucket, however many
parameters it holds. Host time is what bounds a step of a mid-sized model (the anchor
transformer on an H200 spends half its step with the GPU idle, waiting for the host to
issue kernels), so nothing here runs per parameter unless it must.

When to reduce is a measured choice (bench/gpu_ddp_scaling.py, bench/gpu_ddp_profile.py):
- After backward (the default inside one host): one bucket per dtype, reduced once backward
  is done. A hook on the module's output queues the work when backward starts; no per-
  parameter hook runs. Over NVLink the reduction takes a few milliseconds at full bandwidth,
  while NCCL kernels running beside backward would take SMs from its matrix multiplications.
- Overlapped (the default across hosts, where the network is slow): buckets in reverse
  parameter order (the order backward produces gradients), the first one small; a cheap
  per-parameter hook counts arrivals and a full bucket is launched at once, always in bucket
  order, so every rank issues the same NCCL sequence while backward goes on.
Either way the caller's stream waits for the reduction on the GPU; the host never blocks.

With `reduce_dtype` (bfloat16, say) an fp32 bucket travels in that type: packed as it is
cast, averaged by NCCL, and cast back as it is unpacked, halving the bytes on the wire.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from smdistributed import _core
from smdistributed.common.bucket_plan import FIRST_BUCKET_BYTES, plan_buckets

from ..cuda_collectives import current_stream
from ..tensors import core_dtype


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], reduce_dtype):
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        wire = reduce_dtype if reduce_dtype is not None and dtype.is_floating_point else dtype
        # Packed in the wire type directly: the cast happens in the packing copy.
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=wire, device=device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)


class GpuGradientBuckets:
    def __init__(self, named_params: Dict[str, torch.nn.Parameter], collectives, bucket_cap_bytes: int,
                 reduce_dtype: Optional[torch.dtype] = None, overlap: bool = True):
        self._gpu = collectives
        self.overlap = overlap
        self._where: Dict[int, _Bucket] = {}  # id(param) -> its bucket
        if not overlap:
            # No cap: one bucket per run of one dtype (the planner still keeps the first small).
            bucket_cap_bytes = 1 << 62
        params = list(named_params.values())
        for p in params:
            core_dtype(p)
        # Reverse parameter order, the order backward produces gradients; a bucket holds one
        # run of one dtype, so buckets fill (and launch) in that order.
        plan = plan_buckets([p.numel() * p.element_size() for p in params], [p.dtype for p in params],
                            bucket_cap_bytes, first_cap=FIRST_BUCKET_BYTES, reverse=True, dtype_runs=True)
        self._buckets: List[_Bucket] = [_Bucket([params[i] for i in bucket], reduce_dtype) for bucket in plan]
        for b in self._buckets:
            for p in b.params:
                self._where[id(p)] = b
        self._next = 0  # the next bucket to launch, in order
        self._last_event = None

    @property
    def bucket_sizes(self) -> List[int]:
        return [b.flat.numel() * b.flat.element_size() for b in self._buckets]

    def gradient_ready(self, p: torch.nn.Parameter) -> None:
        """Overlapped mode: called as p's gradient is accumulated (backward's thread)."""
        b = self._where[id(p)]
        b.pending -= 1
        if b.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        ready = []
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            ready.append(self._buckets[self._next])
            self._next += 1
        if ready:
            self._launch(ready)

    def _launch(self, buckets: List[_Bucket]) -> None:
        """Averages the buckets' gradients in one NCCL launch on the group's stream."""
        gpu = self._gpu
        unpack = []
        for b in buckets:
            grads, views, missing = [], [], []
            for p, v in zip(b.params, b.views):
                if p.grad is None:
                    missing.append((p, v))
                else:
                    grads.append(p.grad)
                    views.append(v)
            # A parameter without a gradient this step takes part as zeros, and gets them.
            with torch.no_grad():
                if missing:
                    torch._foreach_zero_([v for _, v in missing])
                if grads:
                    torch._foreach_copy_(views, grads)  # packs (and casts) on the caller's stream
            for p, v in missing:
                p.grad = torch.zeros_like(p)
                grads.append(p.grad)
                views.append(v)
            unpack.append((grads, views))
        gpu.begin()
        avg = _core.ReduceOp.AVERAGE
        gpu.nccl.group_start()
        try:
            for b in buckets:
                gpu.nccl.allreduce(b.flat.data_ptr(), b.flat.data_ptr(), b.flat.numel(), core_dtype(b.flat), avg)
        finally:
            gpu.nccl.group_end()
        with torch.cuda.stream(gpu.stream), torch.no_grad():
            for grads, views in unpack:
                if grads:
                    torch._foreach_copy_(grads, views)
        self._last_event = gpu.nccl.record()

    def finish(self) -> None:
        """End of backward: every bucket not yet launched is launched (parameters that got no
        gradient as zeros), and the caller's stream waits for the last one."""
        for b in self._buckets[self._next:]:
            b.pending = 0
        self._launch_ready()
        if self._last_event is not None:
            self._last_event.block(current_stream(self._gpu.device))
        for b in self._buckets:
            b.pending = len(b.params)
        self._next = 0
