"""CPU collectives while torch's default device is another (argv[1]: "cuda", common in scripts,
or "meta", which any machine has): the backend's own staging buffers must be host memory,
whatever the default. Before they named their device, a gather or an all_to_all of CPU tensors
under a CUDA default (torch 2.11, one H200) handed the engine a GPU pointer, and the rank
crashed. (torch 2.13 on CPU did not apply the default inside the backend's methods: there the
"meta" run passes either way.) Every result is checked. Prints "DEFAULT DEVICE OK".
"""
import sys

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401


def cpu(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device="cpu")


def main():
    dist.init_process_group(backend="smddp")
    me, P = dist.get_rank(), dist.get_world_size()
    torch.set_default_device(sys.argv[1])

    outs = [torch.zeros(3, device="cpu") for _ in range(P)]
    dist.all_gather(outs, cpu([me, me + 1, me + 2]))
    assert all(torch.equal(o, cpu([r, r + 1, r + 2])) for r, o in enumerate(outs)), outs

    flat = torch.zeros(2 * P, device="cpu")
    dist.all_gather_into_tensor(flat, cpu([me, -me]))
    assert torch.equal(flat, cpu([v for r in range(P) for v in (r, -r)])), flat

    outs = [torch.zeros(2, device="cpu") for _ in range(P)]
    dist.all_to_all(outs, [cpu([10 * me + r, 100 * me + r]) for r in range(P)])
    assert all(torch.equal(o, cpu([10 * r + me, 100 * r + me])) for r, o in enumerate(outs)), outs

    gathered = [torch.zeros(1, device="cpu") for _ in range(P)] if me == 0 else None
    dist.gather(cpu([me * 7]), gathered, dst=0)
    if me == 0:
        assert all(torch.equal(g, cpu([r * 7])) for r, g in enumerate(gathered)), gathered

    got = torch.zeros(2, device="cpu")
    dist.scatter(got, [cpu([r, r * r]) for r in range(P)] if me == 0 else None, src=0)
    assert torch.equal(got, cpu([me, me * me])), got

    objs = [None] * P
    dist.all_gather_object(objs, {"rank": me})
    assert objs == [{"rank": r} for r in range(P)], objs

    dist.barrier()
    torch.set_default_device("cpu")
    dist.destroy_process_group()
    print("DEFAULT DEVICE OK", flush=True)


if __name__ == "__main__":
    main()
