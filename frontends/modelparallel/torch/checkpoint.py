"""smp.save and smp.load: torch.save/torch.load with one file per model-parallel rank; and
smp.save_checkpoint / smp.resume_from_checkpoint, which write a checkpoint folder.

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
    if not partial and pickle_module is pickle:
        # Every rank reads the full file but keeps only its partition: mapped, only the pages of
        # what it copies are read.
        pickle_load_args.setdefault("mmap", True)
    return torch.load(path, map_location=map_location, pickle_module=pickle_module, weights_only=False,
                      **pickle_load_args)


# -- save_checkpoint / resume_from_checkpoint (the later v1 releases' API) ------------------------
#
#   path/
#     <tag>_partial/           partial checkpoint: one model and one optimizer file per pipeline
#       model_<pp_rank>.pt     rank (written by its dp rank 0), user_content.pt
#       optimizer_<pp_rank>.pt
#       user_content.pt
#     <tag>                    full checkpoint: the whole model's state dict (torch.load-able
#                              into the plain module)
#     optimizer_<tag>          the whole optimizer's state, user_content_<tag>
#     newest                   the tag of the newest complete checkpoint, written last
#
# Every file is written under a temporary name and renamed; `newest` changes only after every
# rank has finished writing (a barrier), so a crash mid-save leaves the previous checkpoint
# as the newest and loadable.

def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_newest(path: str, tag: str) -> None:
    tmp = os.path.join(path, f"newest.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
    os.replace(tmp, os.path.join(path, "newest"))


def save_checkpoint(path: str, tag: str, partial: bool = True, model=None, optimizer=None, user_content=None,
                    translate_if_full: bool = True, num_kept_partial_checkpoints=None) -> None:
    """Every rank calls it with the same tag (gathering a full state is collective)."""
    import torch.distributed as dist

    state.require_init("smp.save_checkpoint")
    if not isinstance(tag, str) or not tag or "/" in tag:
        raise ValueError(f"smp.save_checkpoint: tag must be a non-empty file name, got {tag!r}")
    topo = state.topo
    writer = topo.dp_rank == 0
    os.makedirs(path, exist_ok=True)
    if partial:
        folder = os.path.join(path, f"{tag}_partial")
        os.makedirs(folder, exist_ok=True)
        if writer and model is not None:
            _atomic_save(model.local_state_dict(), os.path.join(folder, f"model_{topo.pp_rank}.pt"))
        if writer and optimizer is not None:
            _atomic_save(optimizer.local_state_dict(), os.path.join(folder, f"optimizer_{topo.pp_rank}.pt"))
        if topo.rank == 0:
            _atomic_save({"user_content": user_content, "partitions": topo.pp_size},
                         os.path.join(folder, "user_content.pt"))
    else:
        model_state = model.state_dict() if model is not None else None
        optimizer_state = optimizer.state_dict() if optimizer is not None else None
        if topo.rank == 0:
            if model_state is not None:
                _atomic_save(model_state, os.path.join(path, tag))
            if optimizer_state is not None:
                _atomic_save(optimizer_state, os.path.join(path, f"optimizer_{tag}"))
            _atomic_save({"user_content": user_content}, os.path.join(path, f"user_content_{tag}"))
    dist.barrier()
    if topo.rank == 0:
        _write_newest(path, tag)
        if partial and num_kept_partial_checkpoints:
            _prune(path, num_kept_partial_checkpoints)
    dist.barrier()


def _prune(path: str, keep: int) -> None:
    import shutil

    folders = sorted((os.path.join(path, d) for d in os.listdir(path) if d.endswith("_partial")),
                     key=os.path.getmtime)
    for old in folders[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resume_from_checkpoint(path: str, tag=None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function=None):
    """Loads into the DistributedModel (and DistributedOptimizer) of this process; before the
    partition, the states are applied once it exists. Returns the saved user_content."""
    state.require_init("smp.resume_from_checkpoint")
    model = state.model
    optimizer = state.optimizers[-1] if state.optimizers else None
    if tag is None:
        newest = os.path.join(path, "newest")
        if not os.path.exists(newest):
            raise FileNotFoundError(f"smp.resume_from_checkpoint: {newest} does not exist (no complete checkpoint "
                                    f"in {path}; pass tag= to name one)")
        with open(newest) as f:
            tag = f.read().strip()
    topo = state.topo
    if partial:
        folder = os.path.join(path, f"{tag}_partial")
        info_file = os.path.join(folder, "user_content.pt")
        if not os.path.exists(info_file):
            raise FileNotFoundError(f"smp.resume_from_checkpoint: {info_file} does not exist (no partial checkpoint "
                                    f"tagged {tag!r} in {path})")
        info = torch.load(info_file, weights_only=False)
        if info["partitions"] != topo.pp_size:
            raise RuntimeError(f"smp.resume_from_checkpoint: {folder} holds a checkpoint of {info['partitions']} "
                               f"partitions, but this run has {topo.pp_size}; load a full checkpoint "
                               "(partial=False) to change the number of partitions")
        model_file = os.path.join(folder, f"model_{topo.pp_rank}.pt")
        if model is not None:
            if not os.path.exists(model_file):
                raise FileNotFoundError(f"smp.resume_from_checkpoint: {model_file} does not exist")
            model.load_state_dict(torch.load(model_file, weights_only=False), strict=strict)
        optimizer_file = os.path.join(folder, f"optimizer_{topo.pp_rank}.pt")
        if load_optimizer and optimizer is not None:
            if not os.path.exists(optimizer_file):
                raise FileNotFoundError(f"smp.resume_from_checkpoint: {optimizer_file} does not exist")
            optimizer.load_state_dict(torch.load(optimizer_file, weights_only=False))
        return info["user_content"]
    full = os.path.join(path, tag)
    if model is not None:
        if not os.path.exists(full):
            raise FileNotFoundError(f"smp.resume_from_checkpoint: {full} does not exist (no full checkpoint tagged "
                                    f"{tag!r})")
        model.load_state_dict(torch.load(full, weights_only=False), strict=strict)
    optimizer_file = os.path.join(path, f"optimizer_{tag}")
    if load_optimizer and optimizer is not None and os.path.exists(optimizer_file):
        optimizer.load_state_dict(torch.load(optimizer_file, weights_only=False))
    content = os.path.join(path, f"user_content_{tag}")
    return torch.load(content, weights_only=False)["user_content"] if os.path.exists(content) else None
