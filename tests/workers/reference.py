"""Deterministic per-rank inputs and the single-process (numpy) results to compare with.

Every rank can build every other rank's input from the seed, so each rank checks its own
result against a computation that involves no communication at all.
"""
import numpy as np

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
OPS = ["sum", "average", "min", "max", "product"]


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def storage_dtype(dtype: str):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def make_input(dtype: str, rank: int, count: int, seed: int, op: str = "sum") -> np.ndarray:
    """Small integer values: exact in every dtype, so sums and products of a few ranks stay exact."""
    rng = np.random.default_rng(seed * 7919 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    lo, hi = (1, 3) if op == "product" else (-5, 6)
    if dtype.startswith("uint"):
        lo, hi = max(lo, 0), hi
    vals = rng.integers(lo, hi, count)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(vals.astype(np.float32))
    return vals.astype(dtype)


def as_float(dtype: str, a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(a) if dtype == "bfloat16" else a


def reduce_reference(dtype: str, op: str, inputs):
    """What allreduce must produce, computed in one process."""
    if dtype == "bool":
        stack = np.stack(inputs)
        return {"min": np.logical_and.reduce, "product": np.logical_and.reduce,
                "max": np.logical_or.reduce, "sum": np.logical_or.reduce}[op](stack, axis=0)
    if dtype in ("float16", "bfloat16"):
        # float16/bfloat16 accumulate in float32 and round once.
        stack = np.stack([as_float(dtype, a).astype(np.float32) for a in inputs])
        r = {"sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}.get(op, np.sum)(stack, axis=0)
        if op == "average":
            r = r / np.float32(len(inputs))
        r = r.astype(np.float32)
        return f32_to_bf16_bits(r) if dtype == "bfloat16" else r.astype(np.float16)
    stack = np.stack(inputs)
    if op == "average":
        s = np.sum(stack, axis=0, dtype=stack.dtype)  # integer sums wrap like the core's
        if np.issubdtype(stack.dtype, np.integer):
            return np.trunc(s.astype(np.float64) / len(inputs)).astype(stack.dtype)
        return (s / stack.dtype.type(len(inputs))).astype(stack.dtype)
    fn = {"sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}[op]
    return fn(stack, axis=0, dtype=stack.dtype) if op in ("sum", "product") else fn(stack, axis=0)


def assert_close(dtype: str, got: np.ndarray, want: np.ndarray, what: str):
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        g = as_float(dtype, got).astype(np.float64)
        w = as_float(dtype, want).astype(np.float64)
        rtol = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[dtype]
        if not np.allclose(g, w, rtol=rtol, atol=rtol):
            bad = np.flatnonzero(~np.isclose(g, w, rtol=rtol, atol=rtol))[:5]
            raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {g[bad]}, want {w[bad]}")
    elif not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:5]
        raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {got[bad]}, want {want[bad]}")
