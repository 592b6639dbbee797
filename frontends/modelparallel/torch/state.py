"""Process state: the configuration, where this rank sits, and its process groups.

smp.init starts torch.distributed on the smddp backend (unless the script already did) and
makes the groups: one pipeline group per model replica, one data-parallel group per
partition, and, when CUDA is there, a one-way group per ordered pair of pipeline ranks for
tensors that travel through NCCL (see wire.py). Two pipeline ranks on one GPU (a one-GPU machine
running pp=2) cannot share an NCCL communicator: their link carries CUDA tensors through host
memory instead.
"""
from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any, Dict, Optional, Set, Tuple

import torch
import torch.distributed as dist

from smdistributed.common import config as knobs
from smdistributed.dataparallel.torch.cuda_collectives import gpu_identity
from smdistributed.dataparallel.torch.process_group import smddp_group

from .config import Config, resolve
from .topology import Topology


class _State:
    def __init__(self):
        self.initialized = False
        # smp.step calls on this rank, each counted before its batch is checked: replicas compare
        # it before reducing gradients, so that one that skipped a call is out of step, not mixed in.
        self.step_calls = 0
        self.cfg: Optional[Config] = None
        self.topo: Optional[Topology] = None
        self.pp_group = None
        self.dp_group = None
        # The same ranks as dp_group, for the replicas' step agreement only: a communication hook
        # may issue collectives on dp_group from other threads, in an order that differs by rank.
        self.dp_check_group = None
        self.cuda_links: Dict[Tuple[int, int], Any] = {}
        # (src, dst) pipeline ranks of this rank's links whose two ranks share one GPU: NCCL refuses
        # two ranks of a communicator on one device, so their CUDA tensors go through host memory.
        self.host_staged_links: Set[Tuple[int, int]] = set()
        self.local_rank = 0
        self.local_size = 1
        self.model = None
        self.optimizers = []  # DistributedOptimizers: their state follows parameters to the device
        self.tracing = False

    def require_init(self, what: str) -> None:
        if not self.initialized:
            raise RuntimeError(f"{what}: call smp.init() first")


state = _State()


def _world_size_before_init() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"])


def _startup_timeout() -> Dict[str, timedelta]:
    """init_process_group's timeout: SMDDP_TIMEOUT where the user set it, so that ranks whose
    rank 0 died before it served torch's store fail within it instead of waiting torch's 30
    minutes (a launcher that stops every rank when one fails, torchrun or smddprun, makes this
    moot). The smddp groups read the same value as their collectives' timeout either way."""
    raw = os.environ.get("SMDDP_TIMEOUT", "").strip()
    if not raw:
        return {}
    try:
        seconds = float(raw)
        return {"timeout": timedelta(seconds=seconds)} if seconds > 0 else {}
    except (ValueError, OverflowError):  # not a number; inf or too large for a timedelta
        raise ValueError(f"SMDDP_TIMEOUT={raw!r} is not a finite number of seconds") from None


def init(config: Optional[Dict[str, Any]] = None) -> None:
    if state.initialized:
        raise RuntimeError("smp.init() was already called in this process")
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401 (registers smddp, fills RANK...)

    cfg = resolve(config, _world_size_before_init())  # checked before any communication
    link_ctas = _p2p_max_ctas()
    if not dist.is_initialized():
        startup = _startup_timeout()
        dist.init_process_group("smddp", **startup)
        if startup:
            # Only the rendezvous is bounded: torch leaves the timeout on the store that every
            # later group shares, where it would also cut short the waits of new_group (NCCL's
            # unique ids), whose own failures name the missing rank.
            dist.distributed_c10d._get_default_store().set_timeout(dist.default_pg_timeout)
    state.local_rank = int(os.environ.get("LOCAL_RANK", 0))  # device() reads it below
    state.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    topo = Topology(dist.get_rank(), dist.get_world_size(), cfg.partitions, cfg.placement_strategy)
    # Every rank makes every group, in the same order (new_group is collective over the world).
    for d in range(topo.dp_size):
        g = dist.new_group(topo.pp_group_of(d))
        if d == topo.dp_rank:
            state.pp_group = g
    for p in range(topo.pp_size):
        g = dist.new_group(topo.dp_group_of(p))
        check = dist.new_group(topo.dp_group_of(p)) if topo.dp_size > 1 else None
        if p == topo.pp_rank:
            state.dp_group, state.dp_check_group = g, check
    if topo.pp_size > 1:
        # The pipeline group's engine starts here, on the main thread, once every rank of the
        # pipeline has called smp.init: left to its first use, it started during the first step
        # on whichever pipeline threads sent or received first, beside that step's other work.
        dist.barrier(group=state.pp_group)
    if torch.cuda.is_available() and topo.pp_size > 1:
        gpu_of = _gpu_of_every_rank()
        sharing = set()  # global rank pairs of one replica's pipeline on one GPU (the same on every rank)
        for d in range(topo.dp_size):
            ranks = topo.pp_group_of(d)
            for a in range(topo.pp_size):
                for b in range(topo.pp_size):
                    if a == b:
                        continue
                    mine = d == topo.dp_rank and topo.pp_rank in (a, b)  # a member of this link
                    if gpu_of[ranks[a]] == gpu_of[ranks[b]]:
                        sharing.add(tuple(sorted((ranks[a], ranks[b]))))
                        if mine:
                            state.host_staged_links.add((a, b))
                        continue
                    g = dist.new_group([ranks[a], ranks[b]])
                    if mine:
                        smddp_group(g).limit_nccl_ctas(link_ctas)
                        state.cuda_links[(a, b)] = g
        if sharing and topo.rank == 0:
            pairs = ", ".join(f"{a} and {b}" for a, b in sorted(sharing))
            warnings.warn(f"smp: pipeline ranks share a GPU (global ranks {pairs}): NCCL cannot join two "
                          "ranks on one device, so activations and gradients between them go through host "
                          "memory. Fine for trying a script on one GPU; give each rank its own GPU to train fast.",
                          stacklevel=3)
    state.cfg = cfg
    state.topo = topo
    if state.cuda_links:
        _open_cuda_links(topo)
    state.initialized = True


def _gpu_of_every_rank() -> list:
    """Each global rank's GPU, as smddp tells GPUs apart (gpu_identity)."""
    mine = gpu_identity(device())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _open_cuda_links(topo: Topology) -> None:
    """Send one byte over every CUDA link this rank is on, so that each link's NCCL
    communicator is made here, on the main thread, before any step. Left to its first use, each
    was made during the first step, on pipeline threads, beside that step's other NCCL work.
    Every rank walks the links in one order, (a, b) sorted, and each exchange blocks: the first
    pending link in that order always has both its ranks at it, so this cannot deadlock."""
    dev = device()
    ranks = topo.pp_group_of(topo.dp_rank)
    with torch.cuda.device(dev):
        byte = torch.zeros(1, dtype=torch.uint8, device=dev)
        for (a, b), group in sorted(state.cuda_links.items()):
            if topo.pp_rank == a:
                dist.send(byte, ranks[b], group=group)
            else:
                dist.recv(byte, ranks[a], group=group)
        torch.cuda.synchronize(dev)


def _p2p_max_ctas() -> int:
    raw = knobs.value("SMDDP_SMP_P2P_MAX_CTAS").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"smp: SMDDP_SMP_P2P_MAX_CTAS must be 0 (NCCL's choice) or a positive number "
                         f"of thread blocks, got {raw!r}")
    return n


def device() -> torch.device:
    """Where this rank's partition lives: its GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", state.local_rank % torch.cuda.device_count())
    return torch.device("cpu")
