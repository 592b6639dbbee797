"""The marks a partial (one partition's) state dict carries, and their check on load.

`_smp_is_partial` is the original's mark; `_smp_partitions` and `_smp_pp_rank` are ours, so a
partial state saved from another number of partitions, or another rank's file, is refused with
both named instead of failing later as missing keys or a pipeline waiting for a rank that
could not find its file."""
from __future__ import annotations

from typing import Any, Dict

from .state import state

MARKS = ("_smp_is_partial", "_smp_partitions", "_smp_pp_rank")


def mark(sd: Dict[str, Any]) -> Dict[str, Any]:
    sd["_smp_is_partial"] = True
    sd["_smp_partitions"] = state.topo.pp_size
    sd["_smp_pp_rank"] = state.topo.pp_rank
    return sd


def unmark(sd: Dict[str, Any]) -> Dict[str, Any]:
    for k in MARKS:
        sd.pop(k, None)
    return sd


def take(sd: Dict[str, Any], what: str) -> bool:
    """Pops the marks from `sd`; True if it is partial. Raises if it belongs to another layout."""
    partial = bool(sd.pop("_smp_is_partial", False))
    parts, rank = sd.pop("_smp_partitions", None), sd.pop("_smp_pp_rank", None)
    if partial and parts is not None and parts != state.topo.pp_size:
        raise RuntimeError(f"smp: {what}: the partial state was saved from {parts} partitions, but this run has "
                           f"{state.topo.pp_size}; save a full state (partial=False, or state_dict()) to change "
                           "the number of partitions")
    if partial and rank is not None and rank != state.topo.pp_rank:
        raise RuntimeError(f"smp: {what}: the partial state belongs to pipeline rank {rank}, but this is pipeline "
                           f"rank {state.topo.pp_rank} (each rank loads its own file, f_<mp_rank>)")
    return partial
