"""Pipeline parallelism: smp (simple and interleaved) against torch.distributed.pipelining
(GPipe, 1F1B) with the same split, and the whole model on one device, in the same run.

    torchrun --nproc_per_node 2 bench/pipeline_bench.py                     # 2 GPUs
    torchrun --nproc_per_node 2 bench/pipeline_bench.py --device cpu --small # 2 CPU processes, Gloo peer
    torchrun --nproc_per_node 1 bench/pipeline_bench.py --only single,smp --act-ckpt  # one GPU, memory
    torchrun --nproc_per_node 2 bench/pipeline_bench.py --device cpu --tiny  # the schedules' host cost

The number of partitions is the number of processes.
Model (GPU): 16 TransformerEncoderLayers (width 1024, 16 heads, ffn 4096), bf16 parameters,
batch 64 x 256, loss = mean square of the output, SGD; split 8 + 8 (the anchor's setup).
Prints one 'RESULT {json}' line on rank 0: step time, samples/s, speedup over one device
(ideal P*m/(m+P-1)), idle fraction 1 - speedup/P (bubble plus overheads), peak memory per rank.
"""
import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

import smdistributed.modelparallel.torch as smp
from pipeline_model import encoder_layers, loss_fn, smp_train_step

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--small", action="store_true", help="8 layers of width 256, batch 32 x 64 (for CPUs)")
p.add_argument("--tiny", action="store_true",
               help="16 layers of width 64, batch 64 x 16: compute is negligible, so the step time is the host's "
                    "cost of running the schedule (what bounds the GPU runs at 8 and 16 microbatches)")
p.add_argument("--micro", default="4,8,16")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--only", default="single,torch,smp")
p.add_argument("--pipelines", default="simple,interleaved")
p.add_argument("--act-ckpt", action="store_true",
               help="also time smp with every layer under smp.set_activation_checkpointing (suffix _ckpt)")
p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
args = p.parse_args()
if args.switch_interval is not None:
    import sys
    sys.setswitchinterval(args.switch_interval)
D, H, F, L, B, S = ((256, 8, 1024, 8, 32, 64) if args.small else (64, 4, 256, 16, 64, 16) if args.tiny
                    else (1024, 16, 4096, 16, 64, 256))
DTYPE = torch.float32 if args.device == "cpu" else torch.bfloat16


def layers(n):
    return encoder_layers(n, D, H, F)


def sync():
    if args.device == "cuda":
        torch.cuda.synchronize()


def peak_reset():
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb():
    return torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0


def timed(step, rank_sync):
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync()
            rank_sync()
            t0 = time.perf_counter()
        step()
    sync()
    return (time.perf_counter() - t0) / args.steps


def main():
    smp.init({"partitions": int(os.environ.get("WORLD_SIZE", "2")), "microbatches": 4})
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(smp.local_rank())
        dev = torch.device("cuda", smp.local_rank())
    else:
        dev = torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(dev, DTYPE)
    y = torch.randn(B, S, D, generator=g).to(dev, DTYPE)
    out = dict(world=world, torch=torch.__version__, model=f"{L} encoder layers d{D} ffn{F}, batch {B}x{S}, {DTYPE}",
               device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    peer_backend = "nccl" if args.device == "cuda" else "gloo"
    peer_group = dist.new_group(backend=peer_backend)
    barrier = lambda: dist.barrier(group=peer_group)  # noqa: E731
    micro = [int(m) for m in args.micro.split(",")]
    single = None

    def record(name, t, m, peaks):
        entry = dict(step_ms=t * 1e3, samples_s=B / t, peak_gb=peaks)
        if single:
            entry.update(speedup_vs_single=single / t, ideal=world * m / (m + world - 1),
                         idle_fraction=1 - single / t / world)
        out[name] = entry
        if rank == 0:
            print(name, json.dumps(entry), flush=True)

    def all_peaks():
        t = torch.tensor([peak_gb()], device=dev if args.device == "cuda" else "cpu")
        ts = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(ts, t, group=peer_group)
        return [v.item() for v in ts]

    if "single" in args.only:
        full = torch.nn.Sequential(*layers(L)).to(dev, DTYPE)
        opt = torch.optim.SGD(full.parameters(), lr=1e-3)
        peak_reset()

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(full(x), y).backward()
            opt.step()

        single = timed(step, barrier)
        out["single"] = dict(step_ms=single * 1e3, samples_s=B / single, peak_gb=peak_gb())
        if rank == 0:
            print("single", json.dumps(out["single"]), flush=True)
        del full, opt

    if "torch" in args.only and world > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        for name, Sched in (("torch_gpipe", ScheduleGPipe), ("torch_1f1b", Schedule1F1B)):
            for m in micro:
                per = L // world
                part = torch.nn.Sequential(*layers(L)[rank * per:(rank + 1) * per]).to(dev, DTYPE)
                stage = PipelineStage(part, rank, world, dev, group=peer_group)
                sched = Sched(stage, n_microbatches=m, loss_fn=loss_fn)
                opt = torch.optim.SGD(part.parameters(), lr=1e-3)
                peak_reset()

                def step():
                    opt.zero_grad(set_to_none=True)
                    if rank == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y, losses=[])
                    opt.step()

                t = timed(step, barrier)
                record(f"{name}_m{m}", t, m, all_peaks())
                del part, stage, sched, opt

    if "smp" in args.only:
        model = smp.DistributedModel(torch.nn.Sequential(*layers(L)).to(DTYPE),
                                     trace_device="gpu" if args.device == "cuda" else "cpu")
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        train_step = smp_train_step(smp)
        base = smp._state.cfg
        for suffix in ("", "_ckpt") if args.act_ckpt else ("",):
            if suffix:  # every encoder layer keeps only its input; activations recomputed in backward
                smp.set_activation_checkpointing(model.module, strategy="each")
            for pipeline in args.pipelines.split(","):
                for m in micro:
                    smp._state.cfg = dataclasses.replace(base, microbatches=m, pipeline=pipeline)
                    peak_reset()

                    def step():
                        opt.zero_grad(set_to_none=True)
                        train_step(model, x, y)
                        opt.step()

                    t = timed(step, barrier)
                    record(f"smp_{pipeline}_m{m}{suffix}", t, m, all_peaks())
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
