"""Data parallelism across model replicas (ddp: true): each partition's parameters start equal
on its data-parallel group, and its gradients are averaged over that group after each step."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def broadcast_from_first(tensors: List[torch.Tensor], group, src: int) -> None:
    """Overwrites `tensors` with the dp group's first rank's values (once, after partitioning)."""
    for bucket in _buckets(tensors, 1 << 62):
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat, src, group=group)
        for t, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.data.copy_(v)


def average_gradients(params: List[torch.nn.Parameter], group, dp_size: int, bucket_bytes: int) -> None:
    """Every local parameter takes part (a missing gradient counts as zero), so every rank of
    the group reduces the same buckets in the same order."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    pending = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        flat.div_(dp_size)
        for g, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(v)


def _buckets(tensors: List[torch.Tensor], limit: int) -> List[List[torch.Tensor]]:
    """Consecutive tensors of one device and dtype, up to `limit` bytes a bucket."""
    out: List[List[torch.Tensor]] = []
    open_: Dict[Tuple[torch.device, torch.dtype], Tuple[List[torch.Tensor], int]] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        bucket, size = open_.get(key, ([], 0))
        n = t.numel() * t.element_size()
        if bucket and size + n > limit:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append(t)
        open_[key] = (bucket, size + n)
    out.extend(b for b, _ in open_.values() if b)
    return out
