"""The older API, `smdistributed.dataparallel.torch.distributed` (library v1.3 and before).

Still found in users' scripts. Every function works with the same semantics as the
torch.distributed call it names, on the smddp backend, and warns once that it is
deprecated in favour of that call.
"""
from __future__ import annotations

import enum
import os

import torch.distributed as _dist

from . import torch_smddp  # noqa: F401  (registers the smddp backend)
from .deprecation import warn_once


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


_TORCH_OPS = {
    ReduceOp.SUM: _dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: _dist.ReduceOp.AVG,
    ReduceOp.MIN: _dist.ReduceOp.MIN,
    ReduceOp.MAX: _dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: _dist.ReduceOp.PRODUCT,
}


class group:  # noqa: N801  (the old API's spelling: dist.group.WORLD)
    WORLD = _dist.group.WORLD


def _torch_op(op):
    if isinstance(op, ReduceOp):
        return _TORCH_OPS[op]
    return op  # a torch.distributed.ReduceOp passes through


def is_available() -> bool:
    warn_once("distributed.is_available()", "torch.distributed.is_available()")
    return _dist.is_available()


def init_process_group(*args, **kwargs) -> None:
    """Starts the smddp process group; any backend argument is ignored (it is always smddp)."""
    warn_once("distributed.init_process_group()", 'torch.distributed.init_process_group(backend="smddp")')
    kwargs.pop("backend", None)
    args = args[1:] if args else args  # the old first positional argument was the backend
    if not _dist.is_initialized():
        _dist.init_process_group("smddp", *args, **kwargs)


def is_initialized() -> bool:
    warn_once("distributed.is_initialized()", "torch.distributed.is_initialized()")
    return _dist.is_initialized()


def get_world_size(group=group.WORLD) -> int:
    warn_once("distributed.get_world_size()", "torch.distributed.get_world_size()")
    return _dist.get_world_size(group)


def get_rank(group=group.WORLD) -> int:
    warn_once("distributed.get_rank()", "torch.distributed.get_rank()")
    return _dist.get_rank(group)


def get_local_rank() -> int:
    warn_once("distributed.get_local_rank()", 'int(os.environ["LOCAL_RANK"])')
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_size() -> int:
    warn_once("distributed.get_local_size()", 'int(os.environ["LOCAL_WORLD_SIZE"])')
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def all_reduce(tensor, op=ReduceOp.SUM, group=group.WORLD, async_op=False):
    warn_once("distributed.all_reduce()", "torch.distributed.all_reduce()")
    return _dist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=async_op)


def broadcast(tensor, src=0, group=group.WORLD, async_op=False):
    warn_once("distributed.broadcast()", "torch.distributed.broadcast()")
    return _dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=group.WORLD, async_op=False):
    warn_once("distributed.reduce()", "torch.distributed.reduce()")
    return _dist.reduce(tensor, dst=dst, op=_torch_op(op), group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=group.WORLD, async_op=False):
    warn_once("distributed.all_gather()", "torch.distributed.all_gather()")
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=group.WORLD,
                      async_op=False):
    warn_once("distributed.all_to_all_single()", "torch.distributed.all_to_all_single()")
    return _dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                   async_op=async_op)


def barrier(group=group.WORLD, async_op=False):
    warn_once("distributed.barrier()", "torch.distributed.barrier()")
    return _dist.barrier(group=group, async_op=async_op)
