"""smp.save and smp.load: torch.save/torch.load with one file per model-parallel rank.

With partial=True each mp rank writes (and later reads) `f` + "_" + its mp_rank, the name the
original library gives (seed 004: "the library will create checkpoint.pt_{mprank} for each
mp rank"), so resume scripts written for it find their files. With partial=False only mp
rank 0 writes `f` (callers already restrict saving to dp_rank 0, as the seed shows). Writes
go to a temporary file renamed into place, so a crash mid-save leaves the previous file.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from .state import state


def _partial_name(f: str) -> str:
    return f"{f}_{state.topo.pp_rank}"


def save(obj: Any, f: str, partial: bool = True, pickle_module=pickle, pickle_protocol: int = 2) -> None:
    state.require_init("smp.save")
    if not isinstance(f, str):
        raise TypeError(f"smp.save: f must be a file name (str), got {type(f).__name__}")
    if not partial and state.topo.pp_rank != 0:
        return
    path = _partial_name(f) if partial else f
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(f: str, map_location=None, pickle_module=pickle, partial: bool = True, **pickle_load_args) -> Any:
    state.require_init("smp.load")
    if not isinstance(f, str):
        raise TypeError(f"smp.load: f must be a file name (str), got {type(f).__name__}")
    path = _partial_name(f) if partial else f
    if not os.path.exists(path):
        hint = (f" (a partial checkpoint has one file per mp rank, {f}_0 .. {f}_{state.topo.pp_size - 1}; "
                "was it saved with partial=False, or with another number of partitions?)" if partial
                else " (a full checkpoint is one file; was it saved with partial=True?)")
        raise FileNotFoundError(f"smp.load: {path} does not exist{hint}")
    return torch.load(path, map_location=map_location, pickle_module=pickle_module, weights_only=False,
                      **pickle_load_args)
