"""Torch tensors as the core sees them: dtype codes, reduce ops, contiguity, device checks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from smdistributed import _core

DType = _core.DType
CoreOp = _core.ReduceOp

_DTYPES = {
    torch.float16: DType.float16,
    torch.bfloat16: DType.bfloat16,
    torch.float32: DType.float32,
    torch.float64: DType.float64,
    torch.int8: DType.int8,
    torch.uint8: DType.uint8,
    torch.int32: DType.int32,
    torch.int64: DType.int64,
    torch.bool: DType.bool,
}

_OPS = {
    dist.ReduceOp.RedOpType.SUM: CoreOp.SUM,
    dist.ReduceOp.RedOpType.AVG: CoreOp.AVERAGE,
    dist.ReduceOp.RedOpType.MIN: CoreOp.MIN,
    dist.ReduceOp.RedOpType.MAX: CoreOp.MAX,
    dist.ReduceOp.RedOpType.PRODUCT: CoreOp.PRODUCT,
}


def core_dtype(t: torch.Tensor) -> DType:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(
            f"smddp: unsupported tensor dtype {t.dtype}; supported: float16, bfloat16, float32, float64, "
            "int8, uint8, int32, int64, bool"
        ) from None


def core_op(op) -> CoreOp:
    red = op.op if isinstance(op, dist.ReduceOp) else op
    try:
        return _OPS[red]
    except KeyError:
        raise ValueError(f"smddp: reduce op {red} is not supported; use SUM, AVG, MIN, MAX or PRODUCT") from None


def on_cuda(tensors, what: str) -> bool:
    """Whether a call's tensors are CUDA tensors; a call mixing devices is refused."""
    kinds = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if "cuda" not in kinds:
        return False
    if len(kinds) > 1:
        raise RuntimeError(f"smddp {what}: one call mixes tensors on {', '.join(sorted(kinds))}; "
                           "put them on one device")
    return True


def check_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"smddp {what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise RuntimeError(
            f"smddp {what}: tensor is on {t.device}; the smddp backend handles CPU and CUDA tensors"
        )
    if t.is_sparse:
        raise RuntimeError(f"smddp {what}: sparse tensors are not supported")
    core_dtype(t)


def contiguous(t: torch.Tensor, what: str):
    """(buffer the core can use, function that copies results back into t or None)."""
    check_tensor(t, what)
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.copy_(buf)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
