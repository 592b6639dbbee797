"""Weak scaling of the anchor transformer on GPUs: torch DDP over NCCL, torch DDP over smddp,
and this library's DistributedDataParallel, in the same run.

    smddprun -np 2 python bench/gpu_ddp_scaling.py      (or torchrun --nproc_per_node 2)

The model, data and loop are the anchor's (../shared/anchors/anchor_collectives.py): a
12-layer TransformerEncoder (width 1024, 16 heads, ffn 4096, 151M parameters), batch
16 x 256 per GPU, bf16 autocast, SGD; 5 warmup and 20 timed steps. Scaling efficiency =
one-GPU step time (the same loop without DDP, run on every GPU at once) / step time with
DDP across the GPUs. Configurations are timed in turn, --rounds times, each keeping its best
round (and the slowest rank's time). Rank 0 prints the table and writes bench/results/gpu_ddp_scaling_<n>gpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from smdistributed.dataparallel.torch.parallel import DistributedDataParallel as SmddpDDP

RESULTS = Path(__file__).resolve().parent / "results"


def build(dev, model="anchor"):
    torch.manual_seed(0)
    if model == "resnet50":  # torchvision's, with BatchNorm (DDP broadcasts its buffers every step)
        import torchvision

        return torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
    if model == "gpt2":  # transformers' GPT-2 124M
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config()).to(dev)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 12).to(dev)


def batch(dev, model="anchor"):
    g = torch.Generator(device="cpu").manual_seed(1)
    if model == "resnet50":
        return torch.randn(64, 3, 224, 224, generator=g).to(dev).to(memory_format=torch.channels_last)
    if model == "gpt2":
        return torch.randint(0, 50257, (8, 512), generator=g).to(dev)
    return torch.randn(16, 256, 1024, generator=g).to(dev)


def loss_of(model, x):
    if x.dtype == torch.long:  # GPT-2: language-model loss on its own tokens
        return model(input_ids=x, labels=x).loss
    return model(x).float().pow(2).mean()


def run(model, params, x, steps=20, warmup=5):
    """(wall seconds per step, host seconds per step): the host's figure is the time the loop
    takes to issue the steps, before the final synchronize; equal to the wall time when the
    host is what bounds the step, shorter when the GPU is."""
    opt = torch.optim.SGD(params, lr=1e-3)
    for i in range(steps + warmup):
        if i == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, x)
        loss.backward()
        opt.step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (end - t0) / steps, (issued - t0) / steps


def variants(nccl_group):
    yield "torch DDP, nccl", lambda m: TorchDDP(m, device_ids=[m_dev(m)], process_group=nccl_group)
    yield "torch DDP, nccl, bf16 hook", lambda m: _hooked(TorchDDP(
        m, device_ids=[m_dev(m)], process_group=nccl_group, gradient_as_bucket_view=True, static_graph=True))
    yield "torch DDP, smddp", lambda m: TorchDDP(m, device_ids=[m_dev(m)])
    yield "torch DDP, smddp, bucket view", lambda m: TorchDDP(m, device_ids=[m_dev(m)], gradient_as_bucket_view=True,
                                                              static_graph=True, bucket_cap_mb=100)
    # Diagnostics (where the overlapped reduction's time goes): the reducer with no
    # communication at all; every bucket held until the backward's last one, then all reduced;
    # NCCL limited to a few SMs (SMDDP_NCCL_MAX_CTAS, read when a group makes its communicator).
    yield "torch DDP, smddp, no checks", lambda m: TorchDDP(m, device_ids=[m_dev(m)],
                                                            process_group=_smddp_group_with(SMDDP_CUDA_CHECKS="0"))
    yield "torch DDP, smddp, checks wait", lambda m: TorchDDP(
        m, device_ids=[m_dev(m)], process_group=_smddp_group_with(SMDDP_CUDA_CHECK_BACKLOG="0"))
    yield "torch DDP, smddp, no spinning", lambda m: TorchDDP(m, device_ids=[m_dev(m)],
                                                              process_group=_smddp_group_with(SMDDP_SPIN_US="0"))
    yield "torch DDP, nccl, bucket view", lambda m: TorchDDP(m, device_ids=[m_dev(m)], process_group=nccl_group,
                                                             gradient_as_bucket_view=True, static_graph=True,
                                                             bucket_cap_mb=100)
    # The reducer's own cost, the bound of any backend: DDP over a group of this rank alone
    # runs every autograd hook, bucket copy and launch, and communicates nothing across GPUs.
    yield "torch DDP, one-rank group (reducer alone)", lambda m: TorchDDP(m, device_ids=[m_dev(m)],
                                                                         process_group=_own_group())
    yield "torch DDP, smddp, no communication", lambda m: _with_hook(TorchDDP(m, device_ids=[m_dev(m)]), None,
                                                                     _no_communication)
    yield "torch DDP, smddp, reduce after backward", lambda m: _with_hook(
        TorchDDP(m, device_ids=[m_dev(m)]), _Held(dist.group.WORLD), _reduce_after_backward)
    yield "torch DDP, nccl, reduce after backward", lambda m: _with_hook(
        TorchDDP(m, device_ids=[m_dev(m)], process_group=nccl_group), _Held(nccl_group), _reduce_after_backward)
    for ctas in (2, 4, 8):
        yield f"torch DDP, smddp, {ctas} CTAs", lambda m, c=ctas: TorchDDP(
            m, device_ids=[m_dev(m)], process_group=_smddp_group_with(SMDDP_NCCL_MAX_CTAS=str(c)))
        yield f"torch DDP, nccl, {ctas} CTAs", lambda m, c=ctas: TorchDDP(
            m, device_ids=[m_dev(m)], process_group=_nccl_group_with_ctas(c))
    yield "FSDP2, nccl", lambda m: _fsdp(m, nccl_group)
    yield "FSDP2, smddp", lambda m: _fsdp(m, dist.group.WORLD)
    yield "smdistributed DDP", lambda m: SmddpDDP(m)
    yield "smdistributed DDP, bf16 wire", lambda m: SmddpDDP(m, reduce_dtype=torch.bfloat16)
    yield "smdistributed DDP, overlapped", lambda m: SmddpDDP(m, overlap_communication=True)
    yield "smdistributed DDP, overlapped, bf16, 8 CTAs", lambda m: SmddpDDP(
        m, overlap_communication=True, reduce_dtype=torch.bfloat16, nccl_max_ctas=8)


def m_dev(m):
    return next(m.parameters()).device.index


def _fsdp(model, group):
    """FSDP2 (fully_shard) over `group`: each transformer block sharded, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cuda")
    blocks = getattr(model, "layers", None)
    if blocks is None and hasattr(model, "transformer"):
        blocks = model.transformer.h
    for block in blocks or []:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check_waits(model):
    """(waits, us, queued) of the smddp argument checks of the model's DDP group: how often the
    caller waited for the previous check of a name, for how long in all, and how many checks
    were queued instead (a rank running ahead of its peer); or None."""
    from smdistributed.dataparallel.torch.process_group import smddp_group

    group = getattr(model, "process_group", None)
    if group is None:
        return None
    try:
        link = smddp_group(group)._cuda_collectives
    except RuntimeError:  # not an smddp group
        return None
    if link is None:
        return None
    return link.nccl.check_waits, link.nccl.check_wait_us, link.nccl.checks_deferred


def _smddp_group_with(**env):
    """A new smddp group made (engine and communicator) under these environment settings."""
    os.environ.update(env)
    group = dist.new_group(backend="smddp")
    dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
    for k in env:
        del os.environ[k]
    return group


def _own_group():
    """A NCCL group of this rank alone (every rank makes every singleton, as new_group needs)."""
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r], backend="nccl")
        if r == dist.get_rank():
            mine = group
    return mine


def _nccl_group_with_ctas(ctas):
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = ctas
    return dist.new_group(backend="nccl", pg_options=options)


def _with_hook(ddp, state, hook):
    ddp.register_comm_hook(state, hook)
    return ddp


def _no_communication(state, bucket):
    future = torch.futures.Future(devices=[bucket.buffer().device])
    future.set_result(bucket.buffer())
    return future


class _Held:
    def __init__(self, group):
        self.group, self.buckets = group, []


def _reduce_after_backward(state, bucket):
    """Each bucket waits until DDP hands over the backward's last one; then all are reduced."""
    buffer = bucket.buffer().div_(dist.get_world_size(state.group))
    future = torch.futures.Future(devices=[buffer.device])
    state.buckets.append((buffer, future))
    if bucket.is_last():
        works = [(dist.all_reduce(b, group=state.group, async_op=True), b, f) for b, f in state.buckets]
        state.buckets = []
        for work, b, f in works:
            work.wait()  # the current stream waits for the reduction; the host does not
            f.set_result(b)
    return future


def _hooked(ddp):
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="variant names to run, separated by semicolons")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="print every round's time per configuration")
    ap.add_argument("--tag", default="", help="suffix of the results file (a variant of the environment)")
    ap.add_argument("--model", default="anchor", choices=["anchor", "resnet50", "gpt2"],
                    help="anchor: the anchor transformer (batch 16x256); resnet50: torchvision, batch 64x224^2; "
                         "gpt2: transformers' 124M, batch 8x512")
    args = ap.parse_args()
    dist.init_process_group("smddp")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    nccl = dist.new_group(backend="nccl")
    x = batch(dev, args.model)
    wanted = [v.strip() for v in args.only.split(";") if v.strip()]
    # Every configuration is built once, then timed in turn, round after round, the one-GPU
    # loop among them: a host-bound step drifts with the machine's state, and interleaving
    # gives every configuration the same conditions. Each keeps its best round.
    configs = {"one GPU": build(dev, args.model)}
    params = sum(p.numel() for p in configs["one GPU"].parameters())
    for name, wrap in variants(nccl):
        if not wanted or name in wanted:
            configs[name] = wrap(build(dev, args.model))
    best = {name: float("inf") for name in configs}
    host, per_round = {}, {name: [] for name in configs}
    for r in range(args.rounds):
        for name, model in configs.items():
            wall, issued = run(model, model.parameters(), x)
            per_round[name].append(wall)
            if wall < best[name]:
                best[name], host[name] = wall, issued
            if rank == 0 and args.verbose:
                waits = _check_waits(model)
                print(f"round {r} {name:<40} {wall * 1e3:8.2f} ms/step, host {issued * 1e3:8.2f}"
                      + (f", check waits so far {waits[0]} ({waits[1] / 1e3:.1f} ms), queued {waits[2]}"
                         if waits else ""),
                      flush=True)
    slowest = torch.tensor([best[name] for name in configs], device=dev, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=nccl)  # each configuration's slowest rank
    steps = dict(zip(configs, slowest.tolist()))
    single = steps.pop("one GPU")
    # The host's speed drifts from round to round (up to +-25% on a shared GPU host), so each
    # round's time is also compared with the one-GPU time of the same round (rank 0's).
    paired = {name: statistics.median(o / t for o, t in zip(per_round["one GPU"], times))
              for name, times in per_round.items()}
    results = {name: dict(step_ms=s * 1e3, scaling_eff=single / s, rank0_host_ms=host[name] * 1e3,
                          median_paired_eff=paired[name]) for name, s in steps.items()}
    if rank == 0:
        print(f"{args.model}, {params / 1e6:.0f}M parameters, {n} x {torch.cuda.get_device_name(0)}, "
              f"torch {torch.__version__}; one GPU: {single * 1e3:.2f} ms/step")
        print(f"one GPU: host issues a step in {host['one GPU'] * 1e3:.2f} ms (rank 0)")
        print(f"{'configuration':<40} {'step ms':>8} {'efficiency':>10} {'host ms':>8} {'paired eff':>10}")
        for name, r in results.items():
            print(f"{name:<40} {r['step_ms']:>8.2f} {r['scaling_eff']:>10.3f} {r['rank0_host_ms']:>8.2f} "
                  f"{r['median_paired_eff']:>10.3f}")
        RESULTS.mkdir(exist_ok=True)
        suffix = ("" if args.model == "anchor" else f"_{args.model}") + (f"_{args.tag}" if args.tag else "")
        out = RESULTS / f"gpu_ddp_scaling_{n}gpu{suffix}.json"
        command = f"smddprun -np {n} python bench/gpu_ddp_scaling.py --model {args.model}" + (
            f" --tag {args.tag}" if args.tag else "")
        out.write_text(json.dumps(dict(command=command,
                                       model=args.model, world=n,
                                       device=torch.cuda.get_device_name(0), torch=torch.__version__,
                                       params=params, single_step_ms=single * 1e3, results=results), indent=1))
        print("wrote", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
