"""Argument checks shared by the CPU (process_group.py) and CUDA (cuda_collectives.py) paths of
the smddp backend: each collective's tensor counts, sizes and split sizes are validated here,
once, with the same message on either device, before any pointer is formed from them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def rows(t: torch.Tensor) -> int:
    """Dim 0, the dimension all_to_all splits (a 0-d tensor is one row)."""
    return t.shape[0] if t.dim() else 1


def row_numel(t: torch.Tensor) -> int:
    """Elements per row (from the shape, so a tensor with no rows still has a row size)."""
    n = 1
    for d in (t.shape[1:] if t.dim() else ()):
        n *= d
    return n


def one_per_rank(tensors: Sequence[torch.Tensor], size: int, what: str, role: str) -> None:
    if len(tensors) != size:
        raise ValueError(f"smddp {what}: {len(tensors)} {role} tensors for {size} ranks")


def same_dtype(tensors: Sequence[torch.Tensor], what: str) -> None:
    kinds = {t.dtype for t in tensors}
    if len(kinds) > 1:
        raise TypeError(f"smddp {what}: tensors of different dtypes ({', '.join(sorted(map(str, kinds)))}) "
                        "in one call")


def each_numel(tensors: Sequence[torch.Tensor], numel: int, what: str, role: str) -> None:
    for r, t in enumerate(tensors):
        if t.numel() != numel:
            raise ValueError(f"smddp {what}: {role} tensor {r} has {t.numel()} elements, expected {numel}")


def times_size(big: torch.Tensor, small: torch.Tensor, size: int, what: str, big_role: str) -> None:
    """`big` holds `size` x `small` (all_gather_into_tensor's output, reduce_scatter_tensor's input)."""
    if big.numel() != small.numel() * size:
        raise ValueError(f"smddp {what}: {big_role} has {big.numel()} elements, expected {small.numel()} x {size} "
                         "ranks")
    same_dtype([big, small], what)


def split_sizes(splits: Optional[Sequence[int]], total_rows: int, size: int, what: str, which: str) -> List[int]:
    """all_to_all_single's split sizes: given, one non-negative row count per rank adding up to the
    tensor's rows; not given, the rows split evenly."""
    if splits is None or len(splits) == 0:
        if total_rows % size:
            raise ValueError(f"smddp {what}: dim 0 of the {which} ({total_rows}) does not split evenly over {size} "
                             f"ranks; pass {which}_split_sizes")
        return [total_rows // size] * size
    values = [int(n) for n in splits]
    if len(values) != size:
        raise ValueError(f"smddp {what}: {len(values)} {which} split sizes for {size} ranks")
    if min(values) < 0:
        raise ValueError(f"smddp {what}: negative {which} split size in {values}")
    if sum(values) != total_rows:
        raise ValueError(f"smddp {what}: {which} split sizes {values} add up to {sum(values)} rows, but the {which} "
                         f"has {total_rows}")
    return values
