"""DDP on smddp trains like one process on the whole batch.

Usage: torch_ddp.py VARIANT [VARIANT ...]. Every rank seeds its model with its own rank, so
the ranks start from different weights and DDP must broadcast rank 0's when it wraps the
model. Each rank trains on its slice of a global batch; the single-process reference starts
from rank 0's weights, trains on the whole batch with the same loss (a mean) and plain SGD.
Prints "VARIANT <name> OK max_rel_err=<e>" per variant.
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_common import randn, relative_error, use_test_device

GLOBAL_BATCH = 24  # divides over 2, 3 and 4 ranks, and in halves for no_sync's micro-steps
IN, HIDDEN, OUT = 8, 16, 3
STEPS = 5
LR = 0.1


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class WithUnusedBranch(MLP):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(HIDDEN, OUT)  # never in forward: its gradient never arrives


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


VARIANTS = {
    # name: (model class, DDP keyword arguments, communication hook, tolerance)
    "default": (MLP, {}, None, 1e-5),
    "find_unused_parameters": (WithUnusedBranch, {"find_unused_parameters": True}, None, 1e-5),
    "gradient_as_bucket_view": (MLP, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}, None, 1e-5),
    "static_graph": (MLP, {"static_graph": True}, None, 1e-5),
    "no_sync": (MLP, {}, None, 1e-5),
    "broadcast_buffers": (WithBatchNorm, {"broadcast_buffers": True}, None, 1e-5),
    "allreduce_hook": (MLP, {}, default_hooks.allreduce_hook, 1e-5),
    "fp16_compress_hook": (MLP, {"bucket_cap_mb": 0.0005}, default_hooks.fp16_compress_hook, 2e-3),
}


def build(cls, seed):
    torch.manual_seed(seed)
    return cls()


def batch(step):
    g = torch.Generator(device="cpu").manual_seed(1000 + step)
    return randn(GLOBAL_BATCH, IN, generator=g), randn(GLOBAL_BATCH, OUT, generator=g)


def local_slice(t, P, me):
    n = GLOBAL_BATCH // P
    return t[me * n:(me + 1) * n]


def reference(cls):
    """Single-process training on the whole batch from rank 0's initial weights."""
    model = build(cls, 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


def reference_batchnorm(P):
    """What DDP with broadcast buffers computes, simulated in one process.

    Each step every replica starts from the same parameters and rank 0's buffers (DDP's
    broadcast before forward), normalizes with its own batch statistics, and the gradients are
    averaged. Returns the model after training (rank 0's buffers) and, per step, the buffers
    every rank must see as its forward starts.
    """
    model = build(WithBatchNorm, 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        seen.append({k: v.clone() for k, v in model.bn.named_buffers()})
        grads = [torch.zeros_like(p) for p in model.parameters()]
        rank0_buffers = None
        for r in range(P):
            replica = copy.deepcopy(model)
            F.mse_loss(replica(local_slice(x, P, r)), local_slice(y, P, r)).backward()
            for g, p in zip(grads, replica.parameters()):
                g += p.grad
            if r == 0:
                rank0_buffers = {k: v.clone() for k, v in replica.named_buffers()}
        for p, g in zip(model.parameters(), grads):
            p.grad = g / P
        opt.step()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(rank0_buffers[k])
    return model, seen


def assert_same_on_all_ranks(tensors, what):
    """Every rank holds bit-identical values (DDP's whole point)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    for r, part in enumerate(parts):
        assert torch.equal(part, parts[0]), f"{what}: rank {r} differs from rank 0 by {(part - parts[0]).abs().max()}"


def compare_to(model, ref, tol, what):
    worst = 0.0
    for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == ref_name
        err = relative_error(p.detach(), q.detach())
        assert err <= tol, f"{what}: parameter {name} relative error {err:.3g} > {tol}"
        worst = max(worst, err)
    return worst


def run_variant(name, P, me):
    cls, kwargs, hook, tol = VARIANTS[name]
    model = build(cls, me)  # different initial weights on every rank
    if me != 0:
        assert not torch.equal(model.fc1.weight, build(cls, 0).fc1.weight)
    if torch.get_default_device().type == "cuda":
        kwargs = dict(kwargs, device_ids=[torch.cuda.current_device()])
    ddp = DDP(model, **kwargs)
    # DDP broadcast rank 0's parameters and buffers when it wrapped the model.
    rank0 = build(cls, 0)
    for (n, p), q in zip(model.named_parameters(), rank0.parameters()):
        assert torch.equal(p.detach(), q), f"{name}: parameter {n} is not rank 0's after wrapping"
    if hook is not None:
        ddp.register_comm_hook(None, hook)

    seen = []
    if cls is WithBatchNorm:
        model.bn.register_forward_pre_hook(
            lambda mod, args: seen.append({k: v.clone() for k, v in mod.named_buffers()}))

    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        xs, ys = local_slice(x, P, me), local_slice(y, P, me)
        opt.zero_grad()
        if name == "no_sync":
            # Two micro-steps, gradients accumulated locally and synchronised on the second.
            h = xs.shape[0] // 2
            with ddp.no_sync():
                (F.mse_loss(ddp(xs[:h]), ys[:h]) / 2).backward()
            (F.mse_loss(ddp(xs[h:]), ys[h:]) / 2).backward()
        else:
            F.mse_loss(ddp(xs), ys).backward()
        if name == "find_unused_parameters":
            assert model.unused.weight.grad is None or not model.unused.weight.grad.any()
        opt.step()
        assert_same_on_all_ranks(list(model.parameters()), f"{name} step {step} parameters")

    if cls is WithBatchNorm:
        ref, ref_seen = reference_batchnorm(P)
        assert len(seen) == STEPS
        for step in range(STEPS):
            for k in ("running_mean", "running_var", "num_batches_tracked"):
                err = relative_error(seen[step][k].double(), ref_seen[step][k].double())
                assert err <= tol, f"{name}: step {step} forward saw {k} off rank 0's by {err:.3g}"
        # The buffers each rank used are rank 0's, so they are the same everywhere.
        assert_same_on_all_ranks([seen[-1][k] for k in sorted(seen[-1])], f"{name} buffers seen by forward")
        if me == 0:
            for (k, v), (rk, rv) in zip(model.named_buffers(), ref.named_buffers()):
                assert relative_error(v.double(), rv.double()) <= tol, f"{name}: rank 0's {k} after training"
    else:
        ref = reference(cls)
    worst = compare_to(model, ref, tol, name)
    print(f"VARIANT {name} OK max_rel_err={worst:.2e}", flush=True)


def main(names):
    dist.init_process_group(backend="smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    use_test_device()
    for name in names:
        run_variant(name, P, me)
    dist.destroy_process_group()
    print("DDP OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(VARIANTS))
