"""What torch and its ecosystem ask of a per-device c10d Backend, on the smddp backend:
init_process_group(device_id=...), pg._get_backend(device), new_group, DeviceMesh (1-D and
2-D, collectives over each mesh dimension), split_group (GPUs: torch only splits accelerator
groups), destroy_process_group of a sub-group and of the world. Every result is checked
against what one process computes. Prints "BACKEND API OK".
"""
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from torch_common import native_backend


def check_allreduce(group, ranks, device, me):
    """A sum over `ranks` (global ranks) through `group`, checked element by element."""
    x = torch.arange(5, dtype=torch.float32, device=device) + me
    dist.all_reduce(x, group=group)
    want = sum(torch.arange(5, dtype=torch.float32) + r for r in ranks)
    assert torch.equal(x.cpu(), want), (ranks, x, want)


def check_repeated_step_hits_the_cache(me, device):
    """A DDP step that repeats negotiates nothing new: after a warm-up every allreduce (on CUDA:
    every argument check) is announced by its 4-byte cache id (the engine's counters:
    submitted, hits, misses)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(device)
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.03)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))

    def step():
        opt.zero_grad()
        model(torch.randn(4, 64, device=device)).sum().backward()
        opt.step()

    for _ in range(20):
        step()
    before = backend.engine_counters()
    for _ in range(10):
        step()
    # Checks of CUDA calls are announced by the engine's thread shortly after submission.
    deadline = time.monotonic() + 10
    while True:
        after = backend.engine_counters()
        submitted, hits, misses = (a - b for a, b in zip(after, before))
        if hits + misses >= submitted or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert submitted >= 20 and hits == submitted and misses == 0, (before, after)
    if me == 0:
        print(f"10 repeated DDP steps on {device.type}: {submitted} negotiations, {hits} answered from the cache",
              flush=True)


def main():
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SMDDP_LOCAL_RANK", "0")))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # Lightning and accelerate pass device_id; torch then asks the group for that device's Backend.
    dist.init_process_group("smddp", device_id=device if cuda else None)
    P, me = dist.get_world_size(), dist.get_rank()
    assert native_backend(), "the world group does not run the native Backend"
    world = dist.group.WORLD
    for dev in ("cpu", "cuda"):
        backend = world._get_backend(torch.device(dev))
        assert type(backend).__name__ == "BackendSMDDP", type(backend)
    assert dist.get_backend() == "smddp"
    check_allreduce(None, range(P), device, me)

    # Sub-groups: members compute, the others are not members.
    evens = dist.new_group([r for r in range(P) if r % 2 == 0])
    if me % 2 == 0:
        check_allreduce(evens, [r for r in range(P) if r % 2 == 0], device, me)
    else:
        assert evens == dist.GroupMember.NON_GROUP_MEMBER

    # DeviceMesh: 1-D over the world, and 2-D (rows of 2) with a collective per dimension.
    mesh = init_device_mesh(device.type, (P,))
    check_allreduce(mesh.get_group(), range(P), device, me)
    if P % 2 == 0:
        mesh2 = init_device_mesh(device.type, (P // 2, 2), mesh_dim_names=("dp", "pp"))
        row = [me - me % 2, me - me % 2 + 1]
        col = [r for r in range(P) if r % 2 == me % 2]
        check_allreduce(mesh2.get_group("pp"), row, device, me)
        check_allreduce(mesh2.get_group("dp"), col, device, me)
        # DTensor's redistribution goes through the mesh groups' Backends.
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        full = torch.arange(P * 4, dtype=torch.float32, device=device).reshape(P, 4)
        dt = distribute_tensor(full, mesh2, [Shard(0), Replicate()])
        assert torch.equal(dt.full_tensor().cpu(), full.cpu())

    if cuda:
        # split_group needs a device-bound default group (device_id above) and a splitting Backend.
        halves = [list(range(0, P // 2 or 1)), list(range(P // 2 or 1, P))] if P > 1 else [[0]]
        halves = [h for h in halves if h]
        sub = dist.split_group(split_ranks=halves)
        mine = next(h for h in halves if me in h)
        assert sub is not None
        check_allreduce(sub, mine, device, me)
        dist.destroy_process_group(sub)

    check_repeated_step_hits_the_cache(me, device)

    dist.destroy_process_group(evens) if me % 2 == 0 else None
    check_allreduce(None, range(P), device, me)  # the world still works
    dist.destroy_process_group()
    print("BACKEND API OK", flush=True)


if __name__ == "__main__":
    main()
