"""Importing this module registers "smddp" as a torch.distributed backend:

    import smdistributed.dataparallel.torch.torch_smddp
    torch.distributed.init_process_group(backend="smddp")

It also fills in the variables torch's env:// initialisation reads (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...) from whichever launcher started the process, so the same
script runs under smddprun, torchrun, mpirun or srun, and the original library's
SMDATAPARALLEL_* variables that clients such as Hugging Face transformers read.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from smdistributed.common.discovery import discover, export_original_environment

from .process_group import ProcessGroupSMDDP

BACKEND_NAME = "smddp"


def _create_process_group(store, rank, size, timeout):
    return ProcessGroupSMDDP(store, rank, size, timeout)


def _fill_torch_environment() -> None:
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # torchrun's (or the user's) variables: the original library's names follow them.
        e = os.environ
        for ours, theirs in (("RANK", "RANK"), ("SIZE", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                             ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"), ("SERVER_ADDR", "MASTER_ADDR"),
                             ("SERVER_PORT", "MASTER_PORT")):
            if theirs in e:
                e.setdefault("SMDATAPARALLEL_" + ours, e[theirs])
        return
    world = discover()
    export_original_environment(world)
    defaults = {
        "RANK": world.rank, "WORLD_SIZE": world.size,
        "MASTER_ADDR": world.store_addr or "127.0.0.1",
        # Our own store is not used under torch (the c10d store is), so its port is free.
        "MASTER_PORT": world.store_port or 29500,
    }
    if world.local_rank >= 0:
        defaults.update(LOCAL_RANK=world.local_rank, LOCAL_WORLD_SIZE=world.local_size)
    for key, value in defaults.items():
        os.environ.setdefault(key, str(value))


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu", "cuda"])
_fill_torch_environment()
