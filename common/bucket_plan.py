"""Which tensors travel together: the one bucketing planner of the frontends.

A frontend that packs many small tensors into a few large reductions (the TensorFlow
frontend's grouped allreduce, the older torch `DistributedDataParallel` on CPU and on GPUs)
asks this module for the buckets; it only sees sizes in bytes and dtype keys, so it works
for any framework, and the layouts can be tested without one. What a caller does with a
bucket (a packed buffer, an NCCL call) stays with the caller.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence

# The first bucket of a plan in backward order is kept small: it is the first one that can
# start reducing, so a small one lets communication begin early in backward (torch's DDP
# makes the same choice).
FIRST_BUCKET_BYTES = 1 << 20


def padded(nbytes: int, align: int) -> int:
    """`nbytes` rounded up to a multiple of `align` (the room a tensor takes in a bucket)."""
    return (nbytes + align - 1) // align * align


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence[Hashable], cap: int, *, first_cap: Optional[int] = None,
                 reverse: bool = False, dtype_runs: bool = False, align: int = 1) -> List[List[int]]:
    """Groups tensors into buckets of one dtype holding at most `cap` bytes each.

    `nbytes[i]` and `dtypes[i]` describe tensor i (a dtype is any hashable key). Tensors are
    taken in index order, or from the last when `reverse` (the order backward produces
    gradients). A tensor joins the open bucket of its dtype unless that would take the bucket
    past its cap; then it opens a new one, so a tensor larger than the cap gets a bucket of
    its own. Each tensor takes `padded(nbytes, align)` bytes of room.

    `dtype_runs`: a bucket holds consecutive tensors only, so a change of dtype closes it
    (one open bucket at a time); otherwise each dtype keeps its own open bucket and tensors of
    different dtypes may interleave. `first_cap`: the cap of the first bucket opened (at most
    `cap`).

    Returns the buckets in the order they were opened, each a list of indices in the order
    taken.
    """
    if len(nbytes) != len(dtypes):
        raise ValueError(f"{len(nbytes)} sizes but {len(dtypes)} dtypes")
    limit = cap if first_cap is None else min(first_cap, cap)
    buckets: List[List[int]] = []
    open_of: Dict[Hashable, int] = {}  # dtype -> index into buckets (one entry with dtype_runs)
    filled: List[int] = []  # bytes taken in each bucket
    limits: List[int] = []  # each bucket's cap
    order = range(len(nbytes) - 1, -1, -1) if reverse else range(len(nbytes))
    for i in order:
        room = padded(int(nbytes[i]), align)
        key = dtypes[i]
        if dtype_runs:
            k = open_of.get(key)
            if k is None:
                open_of.clear()  # another dtype: the open bucket closes
        else:
            k = open_of.get(key)
        if k is None or filled[k] + room > limits[k]:
            buckets.append([])
            filled.append(0)
            limits.append(limit)
            limit = cap  # only the first bucket takes first_cap
            k = len(buckets) - 1
            open_of[key] = k
        buckets[k].append(i)
        filled[k] += room
    return buckets
