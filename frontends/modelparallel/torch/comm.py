"""Ranks, groups, and the original's helpers for sending picklable objects.

smp.broadcast is one-sided, as in the original: the source calls broadcast, the others call
recv_from(source, rank_type). Objects travel as bytes in CPU tensors on the world group.
"""
from __future__ import annotations

import enum
import pickle
from typing import Any, List

import torch
import torch.distributed as dist

from .state import state

_TAG_OBJECT = 7201


class CommGroup(enum.Enum):
    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2
    PP_GROUP = 3
    TP_GROUP = 4
    RDP_GROUP = 5


class RankType(enum.Enum):
    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2
    PP_RANK = 3
    TP_RANK = 4
    RDP_RANK = 5


def _topo():
    state.require_init("smp")
    return state.topo


def rank() -> int: return _topo().rank
def size() -> int: return _topo().size
def local_rank() -> int:
    _topo()
    return state.local_rank
def local_size() -> int:
    _topo()
    return state.local_size
def pp_rank() -> int: return _topo().pp_rank
def pp_size() -> int: return _topo().pp_size
def mp_rank() -> int: return _topo().pp_rank
def mp_size() -> int: return _topo().pp_size
def dp_rank() -> int: return _topo().dp_rank
def dp_size() -> int: return _topo().dp_size
def rdp_rank() -> int: return _topo().dp_rank
def rdp_size() -> int: return _topo().dp_size
def tp_rank() -> int:
    _topo()
    return 0
def tp_size() -> int:
    _topo()
    return 1
def get_mp_group() -> List[int]: return list(_topo().pp_group)
def get_pp_group() -> List[int]: return list(_topo().pp_group)
def get_dp_group() -> List[int]: return list(_topo().dp_group)
def get_rdp_group() -> List[int]: return list(_topo().dp_group)
def get_tp_group() -> List[int]: return [_topo().rank]
def get_world_process_group():
    _topo()
    return dist.group.WORLD
def get_mp_process_group():
    _topo()
    return state.pp_group
def get_pp_process_group():
    _topo()
    return state.pp_group
def get_dp_process_group():
    _topo()
    return state.dp_group
def get_rdp_process_group():
    _topo()
    return state.dp_group


def _members(group: CommGroup) -> List[int]:
    t = _topo()
    if not isinstance(group, CommGroup):
        raise TypeError(f"smp: expected an smp.CommGroup (smp.WORLD, smp.MP_GROUP, ...), got {group!r}")
    if group is CommGroup.WORLD:
        return list(range(t.size))
    if group in (CommGroup.MP_GROUP, CommGroup.PP_GROUP):
        return list(t.pp_group)
    if group in (CommGroup.DP_GROUP, CommGroup.RDP_GROUP):
        return list(t.dp_group)
    return [t.rank]


def _process_group(group: CommGroup):
    if group is CommGroup.WORLD:
        return dist.group.WORLD
    if group in (CommGroup.MP_GROUP, CommGroup.PP_GROUP):
        return state.pp_group
    if group in (CommGroup.DP_GROUP, CommGroup.RDP_GROUP):
        return state.dp_group
    return None


def _global_rank(r: int, rank_type: RankType) -> int:
    t = _topo()
    if not isinstance(rank_type, RankType):
        raise TypeError(f"smp: expected an smp.RankType, got {rank_type!r}")
    members = {RankType.WORLD_RANK: list(range(t.size)), RankType.MP_RANK: t.pp_group,
               RankType.PP_RANK: t.pp_group, RankType.DP_RANK: t.dp_group,
               RankType.RDP_RANK: t.dp_group, RankType.TP_RANK: [t.rank]}[rank_type]
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(members):
        raise ValueError(f"smp: {rank_type.name} {r!r} is out of range (0..{len(members) - 1})")
    return members[r]


def _send_bytes(data: bytes, dst: int) -> None:
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, tag=_TAG_OBJECT)
    dist.send(payload, dst, tag=_TAG_OBJECT)


def _recv_bytes(src: int) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src, tag=_TAG_OBJECT)
    payload = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(payload, src, tag=_TAG_OBJECT)
    return payload.numpy().tobytes()


def _before_waiting_on_peers() -> None:
    """Inside a step function on the last stage, an answer to the root may be held for the
    input gradients (held_answers.py): it leaves now, since the root's step function may be
    this call's peer and it waits for that answer first."""
    runtime = getattr(state.model, "_runtime", None)  # (none before the model is partitioned)
    if runtime is not None:
        runtime.flush_held_answer()


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    _before_waiting_on_peers()
    dst = _global_rank(dest_rank, rank_type)
    if dst == rank():
        raise ValueError("smp.send: the destination is this process")
    _send_bytes(pickle.dumps(obj), dst)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    _before_waiting_on_peers()
    src = _global_rank(src_rank, rank_type)
    if src == rank():
        raise ValueError("smp.recv_from: the source is this process")
    return pickle.loads(_recv_bytes(src))


def broadcast(obj: Any, group: CommGroup) -> None:
    _before_waiting_on_peers()
    data = pickle.dumps(obj)
    for r in _members(group):
        if r != rank():
            _send_bytes(data, r)


def allgather(obj: Any, group: CommGroup) -> List[Any]:
    _before_waiting_on_peers()
    members = _members(group)
    if len(members) == 1:
        return [obj]
    out: List[Any] = [None] * len(members)
    dist.all_gather_object(out, obj, group=_process_group(group))
    return out


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    _before_waiting_on_peers()
    if len(_members(group)) > 1:
        dist.barrier(group=_process_group(group))


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)
