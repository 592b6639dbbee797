"""How the dense tensors of one grouped reduction travel: alone, or packed into buckets.

Tensors smaller than the cap are packed, in order, into buckets of one dtype of up to `cap`
bytes (the shared planner, smdistributed.common.bucket_plan), each tensor at a 64-byte
aligned offset, and each bucket is reduced in place as one tensor: one submission per
bucket, so the fusion does not depend on when the engine thread wakes, one copy in and none
out (the outputs are aligned views of the bucket, which TensorFlow adopts without copying).
Larger tensors go alone, out of place; they are submitted first, so the engine starts on
them while Python packs the buckets.
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from smdistributed.common.bucket_plan import padded, plan_buckets

from .bridge import ALIGN, empty_aligned


class PackedBucket(NamedTuple):
    members: List[Tuple[int, int]]  # (tensor index, byte offset in the bucket)
    nbytes: int  # the bucket's size, members padded to ALIGN


def layout(nbytes: Sequence[int], dtypes: Sequence, cap: int) -> Tuple[List[int], List[PackedBucket]]:
    """The tensors that travel alone (`cap` bytes or more) and the buckets of the others;
    empty tensors are in neither (there is nothing to reduce)."""
    alone = [i for i, n in enumerate(nbytes) if n >= cap]
    small = [i for i, n in enumerate(nbytes) if 0 < n < cap]
    packed = []
    for bucket in plan_buckets([nbytes[i] for i in small], [dtypes[i] for i in small], cap, align=ALIGN):
        members, offset = [], 0
        for j in bucket:
            members.append((small[j], offset))
            offset += padded(nbytes[small[j]], ALIGN)
        packed.append(PackedBucket(members, offset))
    return alone, packed


def submit_dense(c, arrays, op_str, base, pre, post, cap, works) -> list:
    """Submits the allreduces of `arrays` (appending their Works to `works`) and returns their
    output arrays, filled on completion."""
    outs = [None] * len(arrays)
    alone, packed = layout([a.nbytes for a in arrays], [a.dtype for a in arrays], cap)
    for i, a in enumerate(arrays):
        if a.nbytes == 0:
            outs[i] = np.empty(a.shape, a.dtype)  # nothing to reduce
    for i in alone:
        a = arrays[i]
        outs[i] = empty_aligned(a.shape, a.dtype)
        works.append(c.allreduce(a, op_str, name=f"{base}.t{i}", out=outs[i], prescale=pre, postscale=post,
                                 async_op=True))
    for k, b in enumerate(packed):
        raw = empty_aligned((b.nbytes,), np.uint8, always=True)
        end = 0
        for i, off in b.members:
            a = arrays[i]
            raw[end:off] = 0  # padding: reduced along, never read
            view = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(view, a)
            outs[i] = view
            end = off + a.nbytes
        raw[end:] = 0
        dtype = arrays[b.members[0][0]].dtype
        works.append(c.allreduce(raw.view(dtype), op_str, name=f"{base}.b{k}", prescale=pre, postscale=post,
                                 async_op=True))
    return outs
