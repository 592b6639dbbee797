"""Shared by the torch workers: deterministic per-rank inputs, single-process references, checks.

Every rank can build every other rank's input from a seed, so each rank checks its own result
against a computation that involves no communication at all.
"""
import os

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers "smddp")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "MIN": dist.ReduceOp.MIN,
       "MAX": dist.ReduceOp.MAX, "PRODUCT": dist.ReduceOp.PRODUCT}
RTOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-12}


def use_test_device() -> bool:
    """With SMDDP_TEST_DEVICE=cuda a worker runs its checks on CUDA tensors (the NCCL data plane):
    this rank's GPU becomes torch's default device, so every tensor the checks make lands there.
    Call it after init_process_group."""
    if os.environ.get("SMDDP_TEST_DEVICE", "cpu") != "cuda":
        return False
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.set_default_device(f"cuda:{torch.cuda.current_device()}")
    return True


def randn(*shape, generator):
    """Seeded normal data, the same on every device: drawn on the CPU, then moved."""
    return torch.randn(*shape, generator=generator, device="cpu").to(torch.get_default_device())


def make_input(dtype, rank, shape, seed, op="SUM"):
    """Small integers: exact in every dtype, so sums and products over a few ranks stay exact."""
    g = torch.Generator(device="cpu").manual_seed(seed * 7919 + rank)
    device = torch.get_default_device()  # the CUDA runs of a worker set a GPU as the default
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, device="cpu").bool().to(device)
    lo, hi = (1, 3) if op == "PRODUCT" else (-5, 6)
    if dtype == torch.uint8:
        lo = max(lo, 0)
    return torch.randint(lo, hi, shape, generator=g, device="cpu").to(dtype).to(device)


def reduce_reference(dtype, op, inputs):
    """What a reduction over `inputs` must give, computed in this process."""
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op in ("MIN", "PRODUCT"):
            return stack.all(dim=0)
        return stack.any(dim=0)  # SUM and MAX are logical or
    wide = torch.float64 if dtype in FLOATS else torch.int64
    stack = torch.stack([t.to(wide) for t in inputs])
    if op == "SUM":
        r = stack.sum(dim=0)
    elif op == "PRODUCT":
        r = stack.prod(dim=0)
    elif op == "MIN":
        r = stack.min(dim=0).values
    elif op == "MAX":
        r = stack.max(dim=0).values
    elif dtype in FLOATS:
        r = stack.sum(dim=0) / len(inputs)
    else:  # integer average truncates toward zero
        r = torch.div(stack.sum(dim=0), len(inputs), rounding_mode="trunc")
    return r.to(dtype)


def assert_same(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if got.dtype in FLOATS:
        tol = RTOL[got.dtype]
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    elif not torch.equal(got, want):
        bad = (got != want).reshape(-1).nonzero().reshape(-1)[:5]
        raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {got.reshape(-1)[bad].tolist()}, "
                             f"want {want.reshape(-1)[bad].tolist()}")


def relative_error(got, want):
    diff = (got.double() - want.double()).norm()
    scale = want.double().norm()
    return float(diff / scale) if scale > 0 else float(diff)


def expect_raises(fn, exc_type, *fragments):
    """Runs fn, which must raise exc_type with every fragment in its message; returns the message."""
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        for f in fragments:
            assert f in msg, f"expected {f!r} in the error message, got: {msg}"
        return msg
    raise AssertionError(f"expected {exc_type.__name__} mentioning {fragments}")


def native_backend() -> bool:
    """Whether the world group runs the C++ c10d Backend (else the Python process group)."""
    try:
        return hasattr(dist.group.WORLD._get_backend(torch.device("cpu")), "impl")
    except RuntimeError:
        return False


def expect_error(fn) -> None:
    """Runs fn, which must raise a RuntimeError; reports it ("raised", report.py)."""
    from report import report

    try:
        fn()
    except RuntimeError as e:
        report("raised", message=str(e).replace("\n", " "))
        return
    raise AssertionError("expected a RuntimeError")
