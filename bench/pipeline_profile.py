"""Where a pipeline step goes: smp against torch's Schedule1F1B, same model and split.

    torchrun --nproc_per_node 2 bench/pipeline_profile.py --micro 4 --trace-dir traces/
    SMDDP_SMP_CUDA_GRAPHS=1 torchrun --nproc_per_node 4 bench/pipeline_profile.py --micro 8   # pp=4, graphed

The pipeline benchmark's model (16 encoder layers d1024, bf16, batch 64 x 256), split evenly
over as many stages as processes.
For each schedule, every rank prints: wall ms per step, the host time to issue one step, the
GPU time between step starts (CUDA events), and GPU kernel time per step; with --trace-dir
each rank writes a torch profiler trace of 2 steps per schedule (bench/gpu_idle_gaps.py
reads them: where the GPU waits and what the host threads did meanwhile).
"""
import argparse
import dataclasses
import gzip
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import smdistributed.modelparallel.torch as smp
from pipeline_model import smp_training_step, torch_1f1b_training_step

ap = argparse.ArgumentParser()
ap.add_argument("--micro", type=int, default=4)
ap.add_argument("--trace-dir", default=None)
ap.add_argument("--only", default="torch_1f1b,smp_interleaved,smp_simple")
ap.add_argument("--switch-interval", type=float, default=None)
args = ap.parse_args()
if args.switch_interval is not None:
    sys.setswitchinterval(args.switch_interval)
D, L, B, S = 1024, 16, 64, 256


def measure(name, step, rank, barrier):
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    barrier()
    t0 = time.perf_counter()
    for _ in range(6):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 6
    barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    issue = time.perf_counter() - t0  # the GPU starts idle: how long the host takes to issue a step
    torch.cuda.synchronize()
    barrier()
    marks = []
    for _ in range(5):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)
        step()
    torch.cuda.synchronize()
    gpu = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    on_gpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.self_device_time_total for e in on_gpu) / 2 / 1e3
    # Without NCCL's kernels, which stay resident while they wait for the peer: the stage's
    # own GPU work, the bound of its cycle.
    compute = sum(e.self_device_time_total for e in on_gpu if "nccl" not in e.key.lower()) / 2 / 1e3
    print(f"[rank {rank}] {name}: wall {wall * 1e3:.1f} ms/step, host issue {issue * 1e3:.1f} ms, "
          f"GPU between steps {' '.join(f'{g:.1f}' for g in gpu)} ms, kernels {kernels:.1f} ms/step "
          f"({compute:.1f} without NCCL's, {compute / args.micro:.2f} a microbatch)", flush=True)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        raw = os.path.join(args.trace_dir, f"{name}.rank{rank}.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    barrier()


def main():
    m = args.micro
    pp = int(os.environ["WORLD_SIZE"])
    smp.init({"partitions": pp, "microbatches": m})
    rank = dist.get_rank()
    torch.cuda.set_device(smp.local_rank())
    dev = torch.device("cuda", smp.local_rank())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(dev, torch.bfloat16)
    y = torch.randn(B, S, D, generator=g).to(dev, torch.bfloat16)
    nccl = dist.new_group(backend="nccl")
    barrier = lambda: dist.barrier(group=nccl)  # noqa: E731
    if "torch_1f1b" in args.only:
        measure(f"torch_1f1b_m{m}", torch_1f1b_training_step(L, rank, pp, dev, nccl, m, x, y), rank, barrier)
    model, smp_step = smp_training_step(smp, L, x, y)
    base = smp._state.cfg
    for pipeline in ("interleaved", "simple"):
        if f"smp_{pipeline}" not in args.only:
            continue
        smp._state.cfg = dataclasses.replace(base, pipeline=pipeline)
        measure(f"smp_{pipeline}_m{m}", smp_step, rank, barrier)
        if model._runtime.graphs.enabled:  # evidence that the figures are of graphed runs
            print(f"[rank {rank}] smp_{pipeline}_m{m} graphs {dict(model._runtime.graphs.counters)}", flush=True)


if __name__ == "__main__":
    main()
    # Torch's Gloo groups left to interpreter exit can abort it (a Gloo thread frees a work
    # holding Python tensors during finalization): end them first.
    torch.distributed.destroy_process_group()
