"""Data parallelism across model replicas (ddp: true): each partition's parameters start equal
on its data-parallel group, and its gradients are averaged over that group after each step."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def broadcast_from_first(tensors: List[torch.Tensor], group, src: int) -> None:
    """Overwrites `tensors` with global rank `src`'s values (the dp group's first rank once
    after partitioning; the replica that trained longest after a join)."""
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
    average_in_place(grads, group, dp_size, bucket_bytes)


# Uneven inputs (DistributedModel.join): before each gradient reduction every replica says
# whether it still trains; one that has run out of batches answers 0 and takes part in that
# reduction with zero gradients, until every replica has answered 0. The sum is divided by
# the initial number of replicas, as torch DDP's join does by default. Joined replicas did not
# apply the last updates, so at the end the parameters and buffers of a replica that trained
# the most steps are broadcast to the others (as DDP's join does with the last joiner's model).
def announce(group, training: bool) -> int:
    flag = torch.tensor([1.0 if training else 0.0])
    dist.all_reduce(flag, group=group)
    return int(flag.item())


def shadow_until_all_joined(params: List[torch.nn.Parameter], buffers: List[torch.Tensor], group, ranks: List[int],
                            dp_size: int, bucket_bytes: int, steps: int) -> None:
    while announce(group, training=False) > 0:
        average_in_place([torch.zeros_like(p) for p in params], group, dp_size, bucket_bytes)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
    dist.all_gather(counts, torch.tensor([steps], dtype=torch.int64), group=group)
    counts = [int(c.item()) for c in counts]
    source = ranks[counts.index(max(counts))]
    broadcast_from_first([*params, *buffers], group, source)


def average_in_place(grads: List[torch.Tensor], group, dp_size: int, bucket_bytes: int) -> None:
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
