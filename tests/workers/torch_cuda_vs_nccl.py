"""Every collective x dtype on CUDA through smddp gives what torch's own NCCL backend gives.

The same inputs (random floats, not just small integers, so rounding shows) go through the
default smddp group and through a torch "nccl" group in the same processes; the results must
agree to the last bit for integers and within one rounding step for floating types. Prints
"CHECKED <collective> <count>" and "CUDA VS NCCL OK".
"""
import torch
import torch.distributed as dist
from torch_common import DTYPES, FLOATS, OPS, use_test_device

TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}


def data(dtype, rank, shape, seed, op="SUM"):
    g = torch.Generator(device="cpu").manual_seed(seed * 101 + rank)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g, device="cpu").bool()
    elif dtype in FLOATS:
        t = (torch.rand(shape, generator=g, dtype=torch.float64, device="cpu") + 0.5 if op == "PRODUCT"
             else torch.randn(shape, generator=g, dtype=torch.float64, device="cpu")).to(dtype)
    else:
        lo, hi = (1, 3) if op == "PRODUCT" else (0 if dtype == torch.uint8 else -50, 50)
        t = torch.randint(lo, hi, shape, generator=g, device="cpu").to(dtype)
    return t.to(torch.get_default_device())


def same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if a.dtype in FLOATS:
        torch.testing.assert_close(a, b, rtol=TOL[a.dtype], atol=TOL[a.dtype], msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: smddp {a.tolist()[:8]} vs nccl {b.tolist()[:8]}"


def both(fn):
    """fn(group) -> tensors; runs it on the smddp world and on the nccl group."""
    return fn(None), fn(NCCL)


def main():
    global NCCL
    dist.init_process_group(backend="smddp")
    use_test_device()
    NCCL = dist.new_group(backend="nccl")
    P, me = dist.get_world_size(), dist.get_rank()
    seed = 0
    n = 0
    for dtype in DTYPES:
        for op in OPS:
            if dtype == torch.bool and op == "AVG":
                continue
            for shape in [(1,), (1000,), (3, 333)]:
                seed += 1
                x = data(dtype, me, shape, seed, op)
                a, b = both(lambda g: (lambda t: (dist.all_reduce(t, op=OPS[op], group=g), t)[1])(x.clone()))
                same(a, b, f"all_reduce {dtype} {op} {shape}")
                for root in range(P):
                    a, b = both(lambda g: (lambda t: (dist.reduce(t, dst=root, op=OPS[op], group=g), t)[1])(x.clone()))
                    if me == root:
                        same(a, b, f"reduce {dtype} {op} root {root}")
                n += 2
            seed += 1
            x = data(dtype, me, (P * 40,), seed, op)
            a, b = both(lambda g: (lambda o: (dist.reduce_scatter_tensor(o, x.clone(), op=OPS[op], group=g), o)[1])(
                torch.zeros(40, dtype=dtype)))
            same(a, b, f"reduce_scatter_tensor {dtype} {op}")
            n += 1
    print("CHECKED reductions", n, flush=True)
    n = 0
    for dtype in DTYPES:
        seed += 1
        x = data(dtype, me, (257,), seed)
        for root in range(P):
            a, b = both(lambda g: (lambda t: (dist.broadcast(t, src=root, group=g), t)[1])(x.clone()))
            same(a, b, f"broadcast {dtype} root {root}")
        a, b = both(lambda g: (lambda o: (dist.all_gather_into_tensor(o, x, group=g), o)[1])(
            torch.zeros(P * 257, dtype=dtype)))
        same(a, b, f"all_gather_into_tensor {dtype}")
        a, b = both(lambda g: (lambda outs: (dist.all_gather(outs, x, group=g), torch.stack(outs))[1])(
            [torch.zeros(257, dtype=dtype) for _ in range(P)]))
        same(a, b, f"all_gather {dtype}")
        y = data(dtype, me, (P * 6, 5), seed)
        a, b = both(lambda g: (lambda o: (dist.all_to_all_single(o, y, group=g), o)[1])(torch.zeros_like(y)))
        same(a, b, f"all_to_all_single {dtype}")
        n += 4
    print("CHECKED data movement", n, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print("CUDA VS NCCL OK", flush=True)


if __name__ == "__main__":
    main()
