"""The rest of the smp API on a real world: ranks and groups for each placement, the object
helpers, and DistributedModel's partition-time methods (hooks, local_*, state_dict, cpu).
argv: placement (cluster | spread). Prints "API OK" on success."""
import sys
from collections import UserDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp

PLACEMENT = sys.argv[1]


def check_ranks_and_groups():
    size, rank = smp.size(), smp.rank()
    pp, dp = smp.pp_size(), smp.dp_size()
    assert (pp, dp) == (2, size // 2) and smp.mp_size() == pp and smp.rdp_size() == dp
    assert (smp.tp_rank(), smp.tp_size()) == (0, 1)
    mp_group, dp_group = smp.get_mp_group(), smp.get_dp_group()
    if PLACEMENT == "cluster":
        assert mp_group == [rank - rank % 2, rank - rank % 2 + 1], mp_group
    else:
        assert mp_group == [rank % dp, rank % dp + dp], mp_group
    assert mp_group[smp.pp_rank()] == rank and dp_group[smp.dp_rank()] == rank
    assert set(mp_group) & set(dp_group) == {rank}
    # The process groups hold those ranks: an all_reduce over each sums their ranks.
    for group, members in ((smp.get_mp_process_group(), mp_group), (smp.get_dp_process_group(), dp_group),
                           (smp.get_world_process_group(), list(range(size)))):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members), (t, members)
    assert smp.is_initialized() and not smp.is_tracing()
    assert (smp.rdp_rank(), smp.rdp_size()) == (smp.dp_rank(), dp)  # no tensor parallelism
    assert (smp.local_rank(), smp.local_size()) == (rank, size)  # one host
    for group, members in ((smp.get_pp_process_group(), mp_group), (smp.get_rdp_process_group(), dp_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members), (t, members)


def check_object_helpers():
    rank = smp.rank()
    if rank == 0:
        smp.broadcast({"from": 0, "list": [1, 2]}, smp.WORLD)
    else:
        assert smp.recv_from(0, smp.RankType.WORLD_RANK) == {"from": 0, "list": [1, 2]}
    if smp.pp_rank() == 0:
        smp.send(("to mp 1", rank), 1, smp.RankType.MP_RANK)
    else:
        assert smp.recv_from(0, smp.RankType.MP_RANK) == ("to mp 1", smp.get_mp_group()[0])
    # A broadcast over each smaller group reaches its members, which name the sender by their
    # rank type in that group.
    if smp.dp_rank() == 0:
        smp.broadcast(("dp", rank), smp.DP_GROUP)
    else:
        assert smp.recv_from(0, smp.RankType.DP_RANK) == ("dp", smp.get_dp_group()[0])
    if smp.pp_rank() == 1:
        smp.broadcast(("mp", rank), smp.MP_GROUP)
    else:
        assert smp.recv_from(1, smp.RankType.MP_RANK) == ("mp", smp.get_mp_group()[1])
    if smp.dp_rank() == 1:
        smp.send(("to dp 0", rank), 0, smp.RankType.DP_RANK)
    else:
        assert smp.recv_from(1, smp.RankType.DP_RANK) == ("to dp 0", smp.get_dp_group()[1])
    assert smp.allgather(rank, smp.MP_GROUP) == smp.get_mp_group()
    assert smp.allgather(rank * 10, smp.DP_GROUP) == [r * 10 for r in smp.get_dp_group()]
    assert smp.allgather("x", smp.WORLD) == ["x"] * smp.size()
    smp.barrier()
    smp.dp_barrier()
    smp.mp_barrier()
    try:
        smp.send(1, 5, smp.RankType.MP_RANK)
    except ValueError as e:
        assert "MP_RANK 5 is out of range" in str(e)
    else:
        raise AssertionError("out-of-range rank accepted")


class Scale(nn.Module):
    """A module with a buffer and no parameters: local_named_buffers, the state dict and the
    move to the owner's device must carry it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.tensor(0.5))

    def forward(self, x):
        return x * self.factor


def build():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), Scale(), nn.Tanh(), nn.Linear(12, 3))


def check_model_api():
    plain = build()
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stays a torch Optimizer
    calls = []
    model.register_post_partition_hook(lambda m: calls.append(m.partitioned))
    # A full state given before the partition is applied once the model is partitioned.
    shifted = {k: v + 1.0 for k, v in plain.state_dict().items()}
    # As torch's: a strict mismatch raises at the call, and the keys come back.
    try:
        model.load_state_dict({**shifted, "bogus": torch.zeros(1)})
        raise AssertionError("a strict load with an unexpected key passed")
    except RuntimeError as e:
        assert "unexpected keys ['bogus']" in str(e), e
    keys = model.load_state_dict({**shifted, "bogus": torch.zeros(1)}, strict=False)
    assert keys.unexpected_keys == ["bogus"] and keys.missing_keys == [], keys
    missing, unexpected = model.load_state_dict(shifted)
    assert missing == [] and unexpected == [] and not model.partitioned

    tracing = []

    @smp.step
    def train_step(model, x, y):
        tracing.append(smp.is_tracing())
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    train_step(model, x, y)
    assert model.partitioned and calls == [True], calls
    # The automatic partition traced the step function once, then it ran per microbatch.
    assert tracing[0] is True and tracing.count(True) == 1 and not smp.is_tracing(), tracing
    local = dict(model.local_named_parameters())
    assert local and len(local) < len(list(model.parameters()))
    assert all(p.grad is not None for p in local.values())
    assert all(p.grad is None for n, p in model.module.named_parameters() if n not in local)
    # Each module, and so the buffer, is local on exactly one pipeline rank of the replica.
    buffers = dict(model.local_named_buffers())
    assert set(buffers) <= {"3.factor"}, buffers
    assert smp.allgather(sorted(buffers), smp.MP_GROUP) in ([["3.factor"], []], [[], ["3.factor"]])
    modules = dict(model.local_named_modules())
    every = smp.allgather(sorted(n for n in modules if n), smp.MP_GROUP)
    assert sorted(every[0] + every[1]) == sorted(n for n, _ in plain.named_modules() if n), every
    assert all(any(m is q for q in model.local_modules()) for m in modules.values())
    if buffers:
        assert buffers["3.factor"].item() == 1.5  # the loaded state (0.5 + 1), on the owner
    assert all(any(p is q for q in model.local_parameters()) for p in local.values())
    partial = model.local_state_dict()
    assert partial["_smp_is_partial"] is True and partial["_smp_partitions"] == smp.pp_size()
    assert partial["_smp_pp_rank"] == smp.pp_rank()
    assert set(partial) - {"_smp_is_partial", "_smp_partitions", "_smp_pp_rank"} == set(local) | set(buffers)
    opt.step()
    scheduler.step()
    # The reference: the same start, one full-batch step.
    plain.load_state_dict(shifted)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    F.cross_entropy(plain(x), y).backward()
    ref_opt.step()
    full = model.state_dict()
    assert set(full) == set(plain.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), k
    model.cpu()
    for k, v in plain.state_dict().items():
        assert torch.allclose(model.module.state_dict()[k], v, rtol=1e-5, atol=1e-6), k


def check_called_step_form():
    """@smp.step(non_split_inputs=..., input_split_axes=...): a weight that is not split and
    an input whose batch axis is 1; StepOutputs for tensors in a dict, a list for the rest."""
    model = smp._state.model

    @smp.step(non_split_inputs=["weight"], input_split_axes={"xt": 1})
    def eval_step(model, xt, weight):
        assert xt.shape == (6, 4) and weight.shape == (3,)  # 8 samples / 2 microbatches, axis 1
        out = model(xt.t())
        return {"weighted": (out * weight).sum(1), "tag": "mb"}

    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        xt = torch.randn(6, 8, generator=g)
        result = eval_step(model, xt, torch.tensor([1.0, 2.0, 3.0]))
    assert isinstance(result["weighted"], smp.StepOutput) and result["tag"] == ["mb", "mb"]
    assert result["weighted"].concat().shape == (8,)
    plain = build()
    plain.load_state_dict(model.state_dict())  # gathered: the same on every rank
    expected = (plain(xt.t()) * torch.tensor([1.0, 2.0, 3.0])).sum(1)
    assert torch.allclose(result["weighted"].concat(), expected, rtol=1e-5, atol=1e-6)


def check_two_model_calls_in_one_step():
    """The step function calls the model twice (two inputs) and backpropagates their sum."""
    model = smp._state.model
    plain = build()
    plain.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)

    @smp.step
    def twice(model, a, b):
        loss = model(a).pow(2).mean() + model(b).tanh().mean()
        model.backward(loss)
        return loss

    for p in model.parameters():
        p.grad = None
    loss = twice(model, a, b).reduce_mean()
    ref = plain(a).pow(2).mean() + plain(b).tanh().mean()
    ref.backward()
    assert torch.allclose(loss, ref.detach(), rtol=1e-5), (loss, ref)
    grads = dict(model.local_named_parameters())
    for name, p in plain.named_parameters():
        if name in grads:
            assert torch.allclose(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7), name


def _reference_with_grads(model, x, out_grad):
    plain = build()
    plain.load_state_dict(model.state_dict())
    out = plain(x)
    out.backward(out_grad(out))
    return plain


def _assert_local_grads_equal(model, plain):
    grads = dict(model.local_named_parameters())
    assert grads
    for name, p in plain.named_parameters():
        if name in grads:
            assert torch.allclose(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7), name


def check_backward_with_output_gradients():
    """model.backward(tensors, grads), a lone gradient tensor as torch.autograd.backward takes
    it: each microbatch's output gradient, averaged over the 2 microbatches by default."""
    model = smp._state.model
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 6, generator=g)

    @smp.step
    def with_grads(model, x):
        out = model(x)
        model.backward([out], torch.full_like(out, 0.5))
        return out

    for p in model.parameters():
        p.grad = None
    with_grads(model, x)
    _assert_local_grads_equal(model, _reference_with_grads(model, x, lambda o: torch.full_like(o, 0.5 / 2)))


def check_gradients_summed_over_microbatches():
    """average_grads_across_microbatches=False: microbatch gradients add up, as one backward of
    the batch's summed loss."""
    model = smp._state.model
    model.average_grads_across_microbatches = False
    g = torch.Generator().manual_seed(13)
    x = torch.randn(8, 6, generator=g)

    @smp.step
    def summed(model, x):
        loss = model(x).pow(2).sum()
        model.backward(loss)
        return loss

    for p in model.parameters():
        p.grad = None
    summed(model, x)
    model.average_grads_across_microbatches = True
    _assert_local_grads_equal(model, _reference_with_grads(model, x, lambda o: 2 * o.detach()))


def check_mapping_batches_are_split():
    """A batch in a mapping that is not a dict (Hugging Face's BatchEncoding is a UserDict) is
    split into microbatches like a dict, and keeps its type."""
    model = smp._state.model
    g = torch.Generator().manual_seed(17)
    batch = UserDict(x=torch.randn(8, 6, generator=g), tag="b")

    @smp.step
    def from_mapping(model, batch):
        assert isinstance(batch, UserDict) and batch["x"].shape == (4, 6) and batch["tag"] == "b", batch
        return model(batch["x"])

    with torch.no_grad():
        out = from_mapping(model, batch)
    plain = build()
    plain.load_state_dict(model.state_dict())
    assert torch.allclose(out.concat(), plain(batch["x"]), rtol=1e-5, atol=1e-6)
    # After the partition too, the keys come back against the whole model (not this rank's part).
    missing, unexpected = model.load_state_dict(model.state_dict())
    assert missing == [] and unexpected == [], (missing, unexpected)


def check_dtype_casts_apply():
    """model.to(dtype) casts every parameter (device moves alone are ignored); smp.checkpoint is
    the activation-checkpointing function, not the checkpoint module."""
    assert callable(smp.checkpoint) and smp.checkpoint.__name__ == "checkpoint"
    model = smp._state.model
    assert model.to("cpu") is model
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    model.to(torch.float32)


smp.init({"partitions": 2, "microbatches": 2, "ddp": True,
          "placement_strategy": PLACEMENT})
check_ranks_and_groups()
check_object_helpers()
check_model_api()
check_called_step_form()
check_two_model_calls_in_one_step()
check_backward_with_output_gradients()
check_gradients_summed_over_microbatches()
check_mapping_batches_are_split()
check_dtype_casts_apply()
print("API OK", flush=True)
