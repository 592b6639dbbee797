"""The reductions the API accepts (`ReduceOp`) and how an `op=`/`average=` pair resolves."""
from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """Reductions. SMDDP's names (AVERAGE, SUM, MIN, MAX) plus PRODUCT; Horovod's module
    constants `Average, Sum, Min, Max, Product` are these members."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    def __repr__(self):
        return f"ReduceOp.{self.name}"


def resolve_op(op, average=None) -> ReduceOp:
    """`op` (a ReduceOp, its name, or None) combined with Horovod's deprecated `average=`."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    if isinstance(op, str):
        key = op.strip().upper()
        key = {"AVG": "AVERAGE", "MEAN": "AVERAGE", "PROD": "PRODUCT"}.get(key, key)
        try:
            op = ReduceOp[key]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.AVERAGE, SUM, MIN, MAX or PRODUCT") from None
    if not isinstance(op, ReduceOp):
        raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.AVERAGE, SUM, MIN, MAX or PRODUCT")
    if op is ReduceOp.ADASUM:
        raise NotImplementedError("the Adasum reduction is not implemented; use ReduceOp.AVERAGE or SUM")
    return op
