"""Torch module semantics that a partitioned model must keep, checked by training against one
process on the same batches. Prints one JSON line per rank ("trained").

argv: case
  modules  (pp=2 x dp=2, manual): hooks and torch.nn.utils.prune on a module its caller does not
           own, an nn.Sequential subclass with a forward of its own, frozen parameters (one of
           them tied across the partitions) under AdamW's weight decay, a named tuple returned
           from the step function.
  bn       (pp=2, automatic, trace_memory_usage): BatchNorm's running statistics (the automatic
           partition's trace runs a forward, here with gradients on, that must leave them as they were).
  padding  (pp=2 x dp=2, automatic): replicas whose first batches differ in sequence length
           (dynamic padding) partition the same way.
"""
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from report import report

import smdistributed.modelparallel.torch as smp

CASE = sys.argv[1]
WIDTH, VOCAB, STEPS, MICRO, BATCH = 16, 10, 3, 2, 8
Result = namedtuple("Result", "output loss")


class Residual(nn.Sequential):
    """A Sequential subclass whose forward is not a plain chain of its children."""

    def forward(self, x):
        return x + super().forward(x)


class ModulesNet(nn.Module):
    def __init__(self):
        super().__init__()
        with smp.partition(0):
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.lower = nn.Linear(WIDTH, WIDTH)
        with smp.partition(1):
            self.res = Residual(nn.Linear(WIDTH, WIDTH), nn.Tanh())
            self.hooked = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied across the partitions, and frozen below
        for m in (self.embed, self.lower):
            m.requires_grad_(False)

    def forward(self, tokens):
        h = self.lower(self.embed(tokens).mean(dim=1))
        return self.head(self.hooked(self.res(h)))


def hook_modules_net(net, calls):
    """Hooks that change inputs, outputs and gradients (each must apply once), and pruning's
    mask, applied by a forward pre-hook from the module's own parameters."""
    m = net.hooked
    m.register_forward_pre_hook(lambda mod, args: (args[0] + 1.0,))

    def double_output(mod, args, out):
        calls.append(out.shape[0])
        return out * 2.0
    m.register_forward_hook(double_output)
    m.register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0] * 0.5,))
    prune.l1_unstructured(m, "weight", amount=0.25)


def bn_net():
    return nn.Sequential(nn.Linear(8, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))


class PaddedNet(nn.Module):
    """Per-token layers, then a mean over the sequence: activation sizes follow its length."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(),
                                                    nn.Linear(4 * WIDTH, WIDTH)) for _ in range(4)])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def build(calls):
    torch.manual_seed(7)
    if CASE == "modules":
        net = ModulesNet()
        hook_modules_net(net, calls)
        return net
    return bn_net() if CASE == "bn" else PaddedNet()


def replica_batches(replica):
    """STEPS batches of this replica: (inputs, targets)."""
    g = torch.Generator().manual_seed(100 + replica)
    out = []
    for _ in range(STEPS):
        if CASE == "bn":
            out.append((torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)))
        elif CASE == "padding":
            length = 3 if replica == 0 else 40  # each replica pads to its own longest sequence
            out.append((torch.randint(0, VOCAB, (BATCH, length), generator=g),
                        torch.randint(0, 4, (BATCH,), generator=g)))
        else:
            out.append((torch.randint(0, VOCAB, (BATCH, 5), generator=g),
                        torch.randint(0, VOCAB, (BATCH,), generator=g)))
    return out


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference(replicas):
    """One process: each step averages the replicas' losses, each the mean of its
    microbatches' losses (BatchNorm sees microbatches, in order, as the pipeline runs them)."""
    calls = []
    net = build(calls)
    opt = optimizer(p for p in net.parameters() if p.requires_grad)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for batches in replicas:
            x, y = batches[step]
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
                loss = F.cross_entropy(net(xm), ym) / (MICRO * len(replicas))
                loss.backward()
                total += loss.item()
        opt.step()
        losses.append(total)
    return net, losses, len(calls)


def main():
    pp = 2
    smp.init({"partitions": pp, "microbatches": MICRO, "pipeline": "simple" if CASE == "bn" else "interleaved",
              "auto_partition": CASE != "modules", "default_partition": 0, "ddp": True})
    replicas = [replica_batches(r) for r in range(smp.dp_size())]
    ref, ref_losses, ref_calls = reference(replicas)

    calls = []
    # bn: the trace also counts what the backward saves, so it records the autograd graph.
    model = smp.DistributedModel(build(calls), trace_memory_usage=CASE == "bn")
    opt = smp.DistributedOptimizer(optimizer(model.parameters()))

    @smp.step
    def train_step(model, x, y):
        out = model(x)
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        return Result(out, loss)

    losses = []
    for step in range(STEPS):
        x, y = replicas[smp.dp_rank()][step]
        opt.zero_grad()
        result = train_step(model, x, y)
        assert isinstance(result, Result) and isinstance(result.loss, smp.StepOutput), type(result)
        loss = result.loss.reduce_mean().detach().clone()
        torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
        opt.step()
        losses.append(loss.item() / smp.dp_size())

    full = model.state_dict()
    ref_sd = ref.state_dict()
    errors = {k: ((full[k].float() - v.float()).abs().max() / (v.float().abs().max() + 1e-12)).item()
              for k, v in ref_sd.items()}
    frozen = [n for n, p in ref.named_parameters() if not p.requires_grad]
    # The hooked module runs once per microbatch of each replica, on its owner only.
    per_pp = [None] * smp.pp_size()
    torch.distributed.all_gather_object(per_pp, len(calls), group=smp.get_mp_process_group())
    report("trained", rank=smp.rank(), dp_rank=smp.dp_rank(), worst_key=max(errors, key=errors.get),
           param_rel_err=max(errors.values()), keys_match=sorted(full) == sorted(ref_sd),
           loss_rel_err=max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)),
           frozen_unchanged=all(torch.equal(full[n], ref_sd[n]) for n in frozen), frozen=frozen,
           hook_calls=sum(per_pp), ref_hook_calls=ref_calls, local=sorted(n for n, _ in model.local_named_modules()))


if __name__ == "__main__":
    main()
