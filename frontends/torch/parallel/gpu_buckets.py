"""Gradient reduction of the older DistributedDataParallel for models on a GPU.

Gradients live in flat GPU buckets: each parameter's .grad is a view into its bucket, so
reducing a bucket is one NCCL call on the gradients themselves, with no copy in or out.

When to reduce is a measured choice (bench/gpu_ddp_scaling.py):
- Overlapped (the default across hosts): buckets follow the reverse order of the parameters,
  the order backward produces gradients in, the first one small so communication starts
  early. A bucket is launched the moment its last gradient is accumulated, always in bucket
  order, so every rank issues the same NCCL sequence while backward goes on.
- After backward (the default inside one host): one bucket per dtype, reduced in one NCCL
  launch once backward is done. Over NVLink the whole reduction takes a few milliseconds at
  full bandwidth, while NCCL kernels running beside backward take SMs from its matrix
  multiplications and cost more than the overlap saves (the anchor transformer on 2 H200s:
  0.66 scaling efficiency overlapped, see bench/results).
Either way the caller's stream waits for the reduction on the GPU; the host never blocks.

With `reduce_dtype` (bfloat16, say) an fp32 bucket travels in that type: it is cast on the
group's stream, averaged by NCCL, and cast back, halving the bytes on the wire.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from smdistributed import _core

from ..cuda_collectives import current_stream
from ..tensors import core_dtype

FIRST_BUCKET_BYTES = 1 << 20


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], reduce_dtype):
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.wire = (torch.empty(self.flat.numel(), dtype=reduce_dtype, device=device)
                     if reduce_dtype is not None and reduce_dtype != dtype and dtype.is_floating_point else None)
        self.pending = len(params)


class GpuGradientBuckets:
    def __init__(self, named_params: Dict[str, torch.nn.Parameter], collectives, bucket_cap_bytes: int,
                 reduce_dtype: Optional[torch.dtype] = None, overlap: bool = True):
        self._gpu = collectives
        self._overlap = overlap
        self._buckets: List[_Bucket] = []
        self._where: Dict[int, tuple] = {}  # id(param) -> (bucket, position)
        if not overlap:
            bucket_cap_bytes = 1 << 62  # one bucket per dtype
        cap = min(FIRST_BUCKET_BYTES, bucket_cap_bytes) if overlap else bucket_cap_bytes
        group: List[torch.nn.Parameter] = []
        size = 0
        for p in list(named_params.values())[::-1]:
            core_dtype(p)
            nbytes = p.numel() * p.element_size()
            if group and (size + nbytes > cap or group[0].dtype != p.dtype):
                self._buckets.append(_Bucket(group, reduce_dtype))
                group, size, cap = [], 0, bucket_cap_bytes
            group.append(p)
            size += nbytes
        if group:
            self._buckets.append(_Bucket(group, reduce_dtype))
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                # The gradient is the bucket: autograd accumulates straight into it.
                with torch.no_grad():
                    if p.grad is not None:
                        b.views[i].copy_(p.grad)
                p.grad = b.views[i]
        self._next = 0  # the next bucket to launch, in order
        self._last_event = None

    @property
    def bucket_sizes(self) -> List[int]:
        return [b.flat.numel() * b.flat.element_size() for b in self._buckets]

    def gradient_ready(self, p: torch.nn.Parameter) -> None:
        """Called as p's gradient is accumulated (on backward's thread and stream)."""
        b, i = self._where[id(p)]
        view = b.views[i]
        if p.grad is not view:
            # zero_grad(set_to_none=True) dropped the view; autograd made a new tensor. Put the
            # gradient back into the bucket (one device copy) and the view back on the parameter.
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view
        b.pending -= 1
        if self._overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        ready = []
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            ready.append(self._buckets[self._next])
            self._next += 1
        if ready:
            self._launch(ready)

    def _launch(self, buckets: List[_Bucket]) -> None:
        """Averages the buckets, in one NCCL launch, on the group's stream."""
        gpu = self._gpu
        gpu.begin()
        avg = _core.ReduceOp.AVERAGE
        with torch.cuda.stream(gpu.stream):
            for b in buckets:
                if b.wire is not None:
                    b.wire.copy_(b.flat)
        gpu.nccl.group_start()
        try:
            for b in buckets:
                t = b.flat if b.wire is None else b.wire
                gpu.nccl.allreduce(t.data_ptr(), t.data_ptr(), t.numel(), core_dtype(t), avg)
        finally:
            gpu.nccl.group_end()
        with torch.cuda.stream(gpu.stream):
            for b in buckets:
                if b.wire is not None:
                    b.flat.copy_(b.wire)
        self._last_event = gpu.nccl.record()

    def finish(self) -> None:
        """End of backward: parameters that got no gradient take part as zeros (or with what
        they accumulated under no_sync), every bucket is launched, and the caller's stream
        waits for the last one."""
        for b in self._buckets[self._next:]:
            if b.pending:
                for i, p in enumerate(b.params):
                    if p.grad is not b.views[i]:
                        with torch.no_grad():
                            if p.grad is not None:
                                b.views[i].copy_(p.grad)
                            else:
                                b.views[i].zero_()
                        p.grad = b.views[i]
                b.pending = 0
        self._launch_ready()
        if self._last_event is not None:
            self._last_event.block(current_stream(self._gpu.device))
        for b in self._buckets:
            b.pending = len(b.params)
        self._next = 0
