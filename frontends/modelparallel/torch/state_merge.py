"""Partial state dicts of the pipeline ranks merged into full ones, and agreement on whether a
merge is needed at all.

A 1B-parameter model's state is gigabytes: pickling it through all_gather_object costs a
pickle, a padded byte tensor per rank on every rank and an unpickle. Instead only the layout
(keys, dtypes, shapes, and any non-tensor values) goes through all_gather_object; each rank's
tensors then travel as one byte pack (each tensor aligned), broadcast from their owner, and
become views of that pack on the receivers.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from .state import state

_ALIGN = 64  # every tensor starts at a multiple of this in a pack, so byte views can be retyped


def _flatten(d: dict, prefix: Tuple = ()) -> List[Tuple[Tuple, Any]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.extend(_flatten(v, prefix + (k,)) if v else [(prefix + (k,), {})])
        else:
            out.append((prefix + (k,), v))
    return out


def _assign(d: dict, path: Tuple, value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _packable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_quantized


def merge_over_pipeline(part: dict) -> dict:
    """Every pipeline rank's `part` (tensors on the CPU), merged into one dict, later ranks'
    top-level keys over earlier ones. Every rank of the pipeline group must call it."""
    me, size = state.topo.pp_rank, state.topo.pp_size
    entries = [(path, v.detach().cpu() if isinstance(v, torch.Tensor) else v) for path, v in _flatten(part)]
    if size == 1:
        return _nest(entries)
    tensors = [(path, v) for path, v in entries if _packable(v)]
    layout = [(path, ("tensor", v.dtype, tuple(v.shape)) if _packable(v) else ("value", v)) for path, v in entries]
    layouts: List[Any] = [None] * size
    dist.all_gather_object(layouts, layout, group=state.pp_group)
    ranks = dist.get_process_group_ranks(state.pp_group)
    merged: Dict[Any, Any] = {}
    for r in range(size):  # rank by rank, the owner broadcasting its pack to the others
        if r == me:
            if tensors:
                _send(tensors, ranks[r])
            rank_entries = entries
        elif any(spec[0] == "tensor" for _, spec in layouts[r]):
            rank_entries = _receive(layouts[r], ranks[r])
        else:
            rank_entries = [(path, spec[1]) for path, spec in layouts[r]]
        merged.update(_nest(rank_entries))
    return merged


def _nest(entries: List[Tuple[Tuple, Any]]) -> dict:
    out: dict = {}
    for path, v in entries:
        _assign(out, path, v)
    return out


def _offsets(sizes: List[int]) -> Tuple[List[int], int]:
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, at


def _send(tensors: List[Tuple[Tuple, torch.Tensor]], src: int) -> None:
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    offsets, total = _offsets(sizes)
    pack = torch.empty(total, dtype=torch.uint8)
    for (_, t), at, n in zip(tensors, offsets, sizes):
        if n:
            pack[at:at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    dist.broadcast(pack, src, group=state.pp_group)


def _receive(layout: List[Tuple[Tuple, Any]], src: int) -> List[Tuple[Tuple, Any]]:
    specs = [(path, spec) for path, spec in layout if spec[0] == "tensor"]
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, (_, dtype, shape) in specs]
    offsets, total = _offsets(sizes)
    pack = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(pack, src, group=state.pp_group)
    received = {}
    for (path, (_, dtype, shape)), at, n in zip(specs, offsets, sizes):
        received[path] = pack[at:at + n].view(dtype).reshape(shape)  # views share the pack: no second copy
    return [(path, received[path] if spec[0] == "tensor" else spec[1]) for path, spec in layout]


def everyone_has_own_part(mine_is_complete: bool) -> bool:
    """Whether every pipeline rank loaded exactly its own partition's entries (then each loads
    them locally and nothing crosses the network). Every rank must call it."""
    if state.topo.pp_size == 1:
        return mine_is_complete
    flag = torch.tensor([1 if mine_is_complete else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=state.pp_group)
    return bool(flag.item())
