"""Bit-exact references for reductions whose every partial sum is exact.

With inputs whose sums are exact in the accumulation type (small integers, or 16-bit floats
of a narrow exponent range), the order in which ranks are combined cannot change a result,
so the core must match these references bit for bit. The rules they encode are the
documented ones (docs/core.md, "Reductions"):
- AVERAGE: the exact sum divided once by the number of ranks (true division for floats,
  truncation toward zero for integers);
- float16/bfloat16 accumulate (and divide) in float32 and round once to their own type.
"""
import numpy as np
from reference import as_float, f32_to_bf16_bits, storage_dtype


def small_ints(dtype: str, rank: int, count: int, seed: int) -> np.ndarray:
    """Integers in [-5, 5] ([0, 5] unsigned, False/True for bool), drawn as bytes (fast)."""
    rng = np.random.default_rng(seed * 7919 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, count, dtype=np.int8).astype(bool)
    vals = rng.integers(0 if dtype.startswith("uint") else -5, 6, count, dtype=np.int8)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(vals.astype(np.float32))
    return vals.astype(dtype)


def make_fractional(dtype: str, rank: int, count: int, seed: int) -> np.ndarray:
    """16-bit floats of magnitude in [1/16, 2) and either sign, with full mantissas: a sum of a
    few spans at most 18 bits, so it is exact in float32, but rounding it to 16 bits (once, or
    at every hop) loses bits."""
    rng = np.random.default_rng(seed * 104729 + rank)
    mag = np.exp2(rng.uniform(-4, 1, count))
    vals = (mag * rng.choice([-1.0, 1.0], count)).astype(np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(vals)
    return vals.astype(np.float16)


def exact_reference(dtype: str, op: str, inputs):
    """What every reduction of `inputs` (one array per rank) must produce, bit for bit."""
    P = len(inputs)
    if dtype == "bool":
        stack = np.stack(inputs)
        return (np.logical_and.reduce if op in ("min", "product") else np.logical_or.reduce)(stack, axis=0)
    if dtype in ("float16", "bfloat16"):
        stack = np.stack([as_float(dtype, a).astype(np.float64) for a in inputs])
        if op in ("sum", "average"):
            r = np.sum(stack, axis=0).astype(np.float32)  # exact: the inputs are chosen so
            if op == "average":
                r = r / np.float32(P)
        else:
            r = {"min": np.min, "max": np.max, "product": np.prod}[op](stack, axis=0).astype(np.float32)
        return f32_to_bf16_bits(r) if dtype == "bfloat16" else r.astype(np.float16)
    stack = np.stack(inputs)
    if op in ("sum", "average"):
        s = np.sum(stack, axis=0, dtype=stack.dtype)  # integer sums wrap, as the core's do
        if op == "sum":
            return s
        if np.issubdtype(stack.dtype, np.integer):
            return np.trunc(s.astype(np.float64) / P).astype(stack.dtype)
        return s / stack.dtype.type(P)
    if op == "product":
        return np.prod(stack, axis=0, dtype=stack.dtype)
    return {"min": np.min, "max": np.max}[op](stack, axis=0)


def assert_exact(dtype: str, got: np.ndarray, want: np.ndarray, what: str) -> int:
    """Bitwise equality, reporting how many elements differ and the first few. Returns the
    number of elements checked."""
    want = np.asarray(want, dtype=storage_dtype(dtype))
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, want {want.shape}")
    if got.size == 0:
        return 0
    g, w = got.view(np.uint8).reshape(got.size, -1), want.view(np.uint8).reshape(want.size, -1)
    differs = np.any(g != w, axis=1)
    if differs.any():
        bad = np.flatnonzero(differs)
        first = bad[:4].tolist()
        raise AssertionError(f"{what}: {bad.size} of {got.size} elements wrong, first at {first}: "
                             f"got {as_float(dtype, got)[first].tolist()}, "
                             f"want {as_float(dtype, want)[first].tolist()}")
    return got.size
