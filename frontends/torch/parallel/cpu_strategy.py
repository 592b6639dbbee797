"""Gradient reduction of the older DistributedDataParallel for models on the CPU.

Gradients are averaged by the process group's engine during backward, in buckets of at
most `bucket_cap_mb` planned once at wrap time (smdistributed.common.bucket_plan): reverse
parameter order, the order backward produces gradients, with a small first bucket so the
engine starts early. A hook on every parameter counts the bucket's arrivals; once every
gradient of a bucket is in, it is packed into the bucket's flat buffer and submitted as one
named allreduce, which the engine reduces on its own thread while backward goes on. At the
end of backward the wrapper waits for them and unpacks, so the optimizer sees averaged
gradients.

The cap is honoured by what is submitted, not by the engine's fusion threshold: that one
belongs to the whole process group (every other user of it fuses by it), so it is left
alone. Buckets are matched across ranks by name, so ranks need not fill them in the same
order, and a parameter a rank did not use this step takes part as zeros.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from smdistributed import _core
from smdistributed.common.bucket_plan import FIRST_BUCKET_BYTES, plan_buckets

from ..tensors import check_tensor, core_dtype


class _Bucket:
    def __init__(self, name: str, params: List[torch.nn.Parameter]):
        self.name = name
        self.params = params
        self.pending = len(params)
        self.flat: Optional[torch.Tensor] = None  # made on first packing (a lone contiguous gradient needs none)
        self.views: List[torch.Tensor] = []
        self.unpack: Optional[List[torch.Tensor]] = None  # gradients to copy the result back into
        self.handle: Optional[int] = None

    def buffer(self) -> torch.Tensor:
        """The tensor to reduce: a lone contiguous gradient itself (no copy), else the
        gradients packed into the flat buffer."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused here this step: zeros, as every rank expects it
            grads.append(p.grad)
        if len(grads) == 1 and grads[0].is_contiguous():
            self.unpack = None
            return grads[0]
        if self.flat is None:
            self.flat = torch.empty(sum(p.numel() for p in self.params), dtype=self.params[0].dtype,
                                        device=self.params[0].device)
            offset = 0
            for p in self.params:
                self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        with torch.no_grad():
            torch._foreach_copy_(self.views, grads)
        self.unpack = grads
        return self.flat


class CpuStrategy:
    def __init__(self, module: torch.nn.Module, params: Dict[str, torch.nn.Parameter], engine, prefix: str,
                 bucket_cap_bytes: int):
        self.syncing = True  # False inside the wrapper's no_sync()
        self._module = module
        self._engine = engine
        self._prefix = prefix
        for name, p in params.items():
            check_tensor(p, f"DistributedDataParallel parameter '{name}'")
        ordered = list(params.values())
        plan = plan_buckets([p.numel() * p.element_size() for p in ordered], [p.dtype for p in ordered],
                            bucket_cap_bytes, first_cap=FIRST_BUCKET_BYTES, reverse=True, dtype_runs=True)
        self._buckets = [_Bucket(f"{prefix}.grad.b{k}", [ordered[i] for i in bucket])
                         for k, bucket in enumerate(plan)]
        self._where = {id(p): b for b in self._buckets for p in b.params}
        self._callback_queued = False
        self._sync_module_states()
        for p in ordered:
            p.register_post_accumulate_grad_hook(self._hook)

    @property
    def bucket_sizes(self) -> List[int]:
        return [sum(p.numel() * p.element_size() for p in b.params) for b in self._buckets]

    # -- states -------------------------------------------------------------------------------
    def _submit(self, op, name: str, t: torch.Tensor, shape: List[int], **kw) -> int:
        return self._engine.submit(op=op, name=name, in_ptr=t.data_ptr(), out_ptr=t.data_ptr(), count=t.numel(),
                                   out_capacity=t.numel() * t.element_size(), dtype=core_dtype(t), shape=shape,
                                   **kw)

    def broadcast(self, prefix: str, tensors: Dict[str, torch.Tensor]) -> None:
        handles = []
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise RuntimeError(f"DistributedDataParallel: '{name}' is not contiguous")
            handles.append(self._submit(_core.OpType.BROADCAST, f"{prefix}.{name}", t.data, list(t.shape), root=0))
        self._wait_all(handles)

    def broadcast_buffers(self, buffers: Dict[str, torch.Tensor]) -> None:
        self.broadcast(f"{self._prefix}.buffer", buffers)

    def _sync_module_states(self) -> None:
        # Every rank starts from rank 0's parameters and buffers.
        with torch.no_grad():
            self.broadcast(f"{self._prefix}.param", dict(self._module.named_parameters()))
            self.broadcast(f"{self._prefix}.buffer", dict(self._module.named_buffers()))

    def watch_outputs(self, output):
        return output  # the hooks on the parameters drive everything

    # -- gradient reduction ----------------------------------------------------------------
    def _hook(self, param: torch.Tensor) -> None:
        if not self.syncing:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b = self._where[id(param)]
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        buf = b.buffer()
        # Flat on every rank, whether this rank packed or reduces a lone gradient in place.
        b.handle = self._submit(_core.OpType.ALLREDUCE, b.name, buf, [buf.numel()],
                                reduce_op=_core.ReduceOp.AVERAGE)

    def _finish_backward(self) -> None:
        # Buckets still open hold parameters this rank did not use: they go now, as zeros.
        self._callback_queued = False
        for b in self._buckets:
            if b.handle is None:
                self._launch(b)
        handles = [b.handle for b in self._buckets]
        for b in self._buckets:
            b.handle = None
            b.pending = len(b.params)
        self._wait_all(handles)
        with torch.no_grad():
            for b in self._buckets:
                if b.unpack is not None:
                    torch._foreach_copy_(b.unpack, b.views)
                    b.unpack = None

    def _wait_all(self, handles) -> None:
        # Every handle is waited for, even after one fails: the engine may still be using the
        # others' buffers.
        first = None
        for h in handles:
            try:
                self._engine.wait(h, -1.0)
            except Exception as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            raise first
