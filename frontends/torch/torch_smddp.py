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
import warnings

import torch.distributed as dist

from smdistributed.common.discovery import discover, export_original_environment

from . import native_backend
from .process_group import ProcessGroupSMDDP, smddp_group  # noqa: F401 (smddp_group: public)

BACKEND_NAME = "smddp"


def _create_backend(dist_backend_opts, backend_options):
    """torch's extended creator: the C++ Backend, which torch attaches to the group for cpu and
    cuda (so device_id=, _get_backend, split_group and DeviceMesh work)."""
    o = dist_backend_opts
    impl = ProcessGroupSMDDP(o.store, o.group_rank, o.group_size, o.timeout)
    return native_backend.load().BackendSMDDP(impl, o.group_rank, o.group_size,
                                              int(o.timeout.total_seconds() * 1000))


def _create_process_group(store, rank, size, timeout):
    return ProcessGroupSMDDP(store, rank, size, timeout)


def _register() -> None:
    module, why = native_backend.try_load()
    if module is not None:
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
        return
    if native_backend.mode() != "python":
        warnings.warn(f"smddp: running the Python process group, not the native c10d Backend ({why}); "
                      "init_process_group(device_id=...), split_group and per-device backends will not work",
                      RuntimeWarning, stacklevel=3)
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu", "cuda"])


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
    _register()
_fill_torch_environment()
