"""Gradient reduction of the older DistributedDataParallel for models on a GPU.

Gradients live in flat GPU buckets: each parameter's .grad is a view into its bucket, so
reducing a bucket is one NCCL call on the gradients themselves, with no copy in or out.
Buckets follow the reverse order of the parameters, the order backward produces gradients
in; the first is small so communication starts early. A bucket is launched the moment its
last gradient is accumulated, always in bucket order, so every rank issues the same NCCL
sequence, on the group's own stream, overlapping the rest of backward. At the end of
backward the caller's stream waits for the last bucket on the GPU; the host never blocks.

With `reduce_dtype` (bfloat16, say) an fp32 bucket travels in that type: it is cast on the
group's stream, averaged by NCCL (which adds in fp32 internally), and cast back, halving
the bytes on the wire and the time NCCL's kernels hold SMs.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from smdistributed import _core

from ..tensors import core_dtype

FIRST_BUCKET_BYTES = 1 << 20


class _Bucket:
    def __init__(self, index: int, names: List[str], params: List[torch.nn.Parameter], reduce_dtype):
        self.index = index
        self.names = names
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
                 reduce_dtype: Optional[torch.dtype] = None):
        self._gpu = collectives
        self._buckets: List[_Bucket] = []
        self._where: Dict[int, tuple] = {}  # id(param) -> (bucket, position)
        names = list(named_params)[::-1]
        cap = min(FIRST_BUCKET_BYTES, bucket_cap_bytes)
        group: List[str] = []
        size = 0

        def close():
            nonlocal group, size, cap
            if group:
                params = [named_params[n] for n in group]
                self._buckets.append(_Bucket(len(self._buckets), group, params, reduce_dtype))
                cap = bucket_cap_bytes
            group, size = [], 0

        for n in names:
            p = named_params[n]
            core_dtype(p)
            nbytes = p.numel() * p.element_size()
            if group and (size + nbytes > cap or named_params[group[0]].dtype != p.dtype):
                close()
            group.append(n)
            size += nbytes
        close()
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
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        gpu = self._gpu
        gpu.begin()
        avg = _core.ReduceOp.AVERAGE
        if b.wire is None:
            gpu.nccl.allreduce(b.flat.data_ptr(), b.flat.data_ptr(), b.flat.numel(), core_dtype(b.flat), avg)
        else:
            with torch.cuda.stream(gpu.stream):
                b.wire.copy_(b.flat)
            gpu.nccl.allreduce(b.wire.data_ptr(), b.wire.data_ptr(), b.wire.numel(), core_dtype(b.wire), avg)
            with torch.cuda.stream(gpu.stream):
                b.flat.copy_(b.wire)
        self._last_event = gpu.nccl.record()

    def finish(self) -> None:
        """End of backward: parameters that got no gradient take part as zeros, every bucket
        is launched, and the caller's stream waits for the last one."""
        for b in self._buckets[self._next:]:
            if b.pending:
                for i, p in enumerate(b.params):
                    if p.grad is None or p.grad is not b.views[i]:
                        if p.grad is not None:
                            with torch.no_grad():
                                b.views[i].copy_(p.grad)
                        else:
                            b.views[i].zero_()
                        p.grad = b.views[i]
                b.pending = 0
        self._launch_ready()
        if self._last_event is not None:
            self._last_event.block(torch.cuda.current_stream(self._gpu.device).cuda_stream)
        for b in self._buckets:
            b.pending = len(b.params)
        self._next = 0
