"""The older API: every smdistributed.dataparallel.torch.distributed function, and the
library's DistributedDataParallel trained 5 steps against single-process training.

Usage: torch_legacy.py api | ddp | ddp-nosync | ddp-unused | ddp-buffers | ddp-group-threshold
"""
import sys
import warnings

import torch

CASE = sys.argv[1]
warnings.simplefilter("always", FutureWarning)
with warnings.catch_warnings(record=True) as caught:
    import smdistributed.dataparallel.torch.distributed as dist
    from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP
    from smdistributed.dataparallel.torch.parallel import DistributedDataParallel as DDP2

    assert DDP is DDP2
    dist.init_process_group()
    dist.init_process_group()  # a second call is harmless, and warns no more
deprecations = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
assert len(deprecations) == 1 and 'init_process_group(backend="smddp")' in deprecations[0], deprecations

P, me = dist.get_world_size(), dist.get_rank()
from torch_common import randn, use_test_device  # noqa: E402  (after the import-time warning check)

use_test_device()  # SMDDP_TEST_DEVICE=cuda: the same checks on this rank's GPU


def check_api():
    assert dist.is_available() and dist.is_initialized()
    assert dist.get_local_rank() == me and dist.get_world_size(dist.group.WORLD) == P
    x = torch.full((5,), float(me + 1))
    dist.all_reduce(x)
    assert torch.all(x == sum(range(1, P + 1)))
    for op, want in [(dist.ReduceOp.AVERAGE, (P + 1) / 2), (dist.ReduceOp.MIN, 1.0), (dist.ReduceOp.MAX, float(P))]:
        x = torch.full((3,), float(me + 1))
        dist.all_reduce(x, op=op)
        assert torch.allclose(x, torch.full((3,), want)), (op, x)
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.wait()
    b = torch.full((4,), me)
    dist.broadcast(b, src=P - 1)
    assert torch.all(b == P - 1)
    outs = [torch.empty(2) for _ in range(P)]
    dist.all_gather(outs, torch.full((2,), float(me)))
    assert [o[0].item() for o in outs] == list(range(P))
    out = torch.empty(P)
    dist.all_to_all_single(out, torch.arange(P, dtype=torch.float32) + 10 * me)
    assert out.tolist() == [10.0 * r + me for r in range(P)], out
    splits_in = [1] * P
    out2 = torch.empty(P)
    dist.all_to_all_single(out2, torch.full((P,), float(me)), output_split_sizes=[1] * P, input_split_sizes=splits_in)
    assert out2.tolist() == [float(r) for r in range(P)]
    dist.barrier()
    print("LEGACY API OK", flush=True)


def model_and_data(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator(device="cpu").manual_seed(99)
    data = [(randn(4 * P, 6, generator=g), randn(4 * P, 3, generator=g)) for _ in range(10)]
    return model, data


class WithUnusedBranch(torch.nn.Module):
    """A parameter no forward uses: its gradient never appears on any rank."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.unused = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.body(x)


def check_ddp(micro_steps: int, unused: bool):
    reference, data = model_and_data(0)  # what rank 0 starts from: DDP broadcasts it at wrap
    model, _ = model_and_data(0 if me == 0 else 100 + me)  # ranks start from different weights
    if unused:
        model, reference = WithUnusedBranch(model), WithUnusedBranch(reference)
    ddp = DDP(model, bucket_cap_mb=0.0005)  # tiny buckets: several fused transfers per step
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    mine = slice(4 * me, 4 * me + 4)
    batches = iter(data)
    for step in range(5):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(micro_steps):
            x, y = next(batches)
            # Single process: the full batch, loss averaged over it (and over micro-steps).
            torch.nn.functional.mse_loss(reference(x), y).div(micro_steps).backward()
            loss = torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).div(micro_steps)
            if micro < micro_steps - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        ref_opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if unused and name.startswith("unused"):
            continue
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (name, (p - q).abs().max())
    print("LEGACY DDP OK", flush=True)


def check_buffers():
    """broadcast_buffers=True: every forward starts from rank 0's buffers (BatchNorm stats)."""
    torch.manual_seed(me)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        x = torch.randn(8, 6) * (me + 1)  # per-rank data: local batch statistics differ
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        model.eval()  # an eval forward broadcasts buffers and leaves them as they arrive
        ddp(x)
        model.train()
        for name, buf in model.named_buffers():
            if not buf.is_floating_point():
                continue
            gathered = [torch.empty_like(buf) for _ in range(P)]
            torch.distributed.all_gather(gathered, buf)
            assert all(torch.equal(gathered[0], g) for g in gathered), (step, name)
    print("LEGACY DDP OK", flush=True)


def check_group_threshold():
    """bucket_cap_mb is the wrapper's own: the process group's fusion threshold stays as it
    was, so another user of the group still fuses by it, while the wrapper submits one engine
    operation per bucket of at most its cap."""
    import numpy as np

    from smdistributed.dataparallel.torch.process_group import smddp_group

    group = smddp_group()
    core = group._core
    threshold = group._engine.fusion_threshold
    model, data = model_and_data(0)
    ddp = DDP(model, bucket_cap_mb=0.0005)  # 524 bytes: this model's gradients in two buckets
    assert group._engine.fusion_threshold == threshold, (group._engine.fusion_threshold, threshold)
    # Another user of the group: two 1 KiB allreduces submitted together travel as one fused
    # transfer (a 524-byte threshold would have sent them apart).
    before = core.counters()["fused_responses"]
    arrays = [np.ones(256, np.float32), np.full(256, 2.0, np.float32)]
    with core.batch():
        works = [core.allreduce(a, name=f"other_user.{i}", async_op=True) for i, a in enumerate(arrays)]
    for w in works:
        w.wait()
    assert core.counters()["fused_responses"] - before == 1, core.counters()
    assert np.all(arrays[0] == P) and np.all(arrays[1] == 2 * P)
    # The wrapper's own reductions: one per bucket, none over its cap.
    sizes = ddp._strategy.bucket_sizes
    assert len(sizes) == 2 and max(sizes) <= 524, sizes
    x, y = data[0]
    mine = slice(4 * me, 4 * me + 4)
    before = core.counters()["submitted"]
    torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
    assert core.counters()["submitted"] - before == 2, core.counters()
    assert group._engine.fusion_threshold == threshold
    print("LEGACY DDP OK", flush=True)


if CASE == "api":
    check_api()
elif CASE == "ddp":
    check_ddp(1, False)
elif CASE == "ddp-nosync":
    check_ddp(2, False)
elif CASE == "ddp-unused":
    check_ddp(1, True)
elif CASE == "ddp-buffers":
    check_buffers()
elif CASE == "ddp-group-threshold":
    check_group_threshold()
