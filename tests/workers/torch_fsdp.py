"""FSDP (fully_shard, FSDP2) on smddp trains a small MLP like one process on the whole batch.

Every rank starts from the same weights (seeded alike; FSDP does not broadcast them) and
trains on its slice of each global batch; parameters are sharded over the ranks, gathered for
forward and backward, and gradients reduce-scattered. At the end the full parameters are
gathered and compared with single-process training. Prints "FSDP OK max_rel_err=<e>".
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch_common import randn, relative_error, use_test_device

GLOBAL_BATCH = 12
IN, HIDDEN, OUT = 8, 32, 5  # 5 rows (and 32 over 3 ranks) do not shard evenly: FSDP pads
STEPS = 3
LR = 0.1


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step):
    g = torch.Generator(device="cpu").manual_seed(2000 + step)
    return randn(GLOBAL_BATCH, IN, generator=g), randn(GLOBAL_BATCH, OUT, generator=g)


def main():
    dist.init_process_group(backend="smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    use_test_device()
    n = GLOBAL_BATCH // P

    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()

    model = build()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    shards = [p for p in model.parameters()]
    assert all(isinstance(p, DTensor) for p in shards), "fully_shard left unsharded parameters"
    mesh_group = model[2].weight.device_mesh.get_group()
    assert dist.get_backend(mesh_group) == "smddp", dist.get_backend(mesh_group)
    rows = torch.empty(HIDDEN).chunk(P)[me].numel()  # FSDP shards dim 0 like torch.chunk
    assert model[2].weight.to_local().shape[0] == rows, model[2].weight.to_local().shape
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x[me * n:(me + 1) * n]), y[me * n:(me + 1) * n]).backward()
        opt.step()

    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor()  # an all-gather through smddp
        err = relative_error(full.detach(), q.detach())
        assert err <= 1e-4, f"FSDP parameter {name}: relative error {err:.3g}"
        worst = max(worst, err)
    dist.destroy_process_group()
    print(f"FSDP OK max_rel_err={worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
