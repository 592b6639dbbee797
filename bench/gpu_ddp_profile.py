"""Where a DDP step of the anchor transformer spends its time on the GPU (torch profiler).

    smddprun -np 2 python bench/gpu_ddp_profile.py [--trace-dir DIR]

For one GPU without DDP, torch DDP over NCCL and over smddp, and this library's DDP (fp32 and bf16 on the
wire), rank 0 prints the wall time per step, the host time of backward, and GPU kernel time
per step by kind (NCCL, matrix multiplications, the rest), then the top kernels.
"""
from __future__ import annotations

import gzip
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from smdistributed.dataparallel.torch.parallel import DistributedDataParallel as SmddpDDP

from gpu_ddp_scaling import build

STEPS = 5
TRACE_DIR = sys.argv[sys.argv.index("--trace-dir") + 1] if "--trace-dir" in sys.argv else None


def kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "matmul" in n:
        return "matmul"
    if "flash" in n or "attention" in n or "fmha" in n:
        return "attention"
    return "other"


def profile_variant(name, model, params, x, rank):
    opt = torch.optim.SGD(params, lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        t0 = time.perf_counter()
        loss.backward()
        host_bwd = time.perf_counter() - t0
        opt.step()
        return host_bwd

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        host = sum(step() for _ in range(STEPS))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / STEPS
    if TRACE_DIR:  # Chrome traces for bench/gpu_idle_gaps.py
        os.makedirs(TRACE_DIR, exist_ok=True)
        raw = os.path.join(TRACE_DIR, name.replace(" ", "_").replace(",", "") + f".rank{rank}.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    if rank != 0:
        return
    by_kind = {}
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        if t <= 0 or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0) + t
        rows.append((t, e.count, e.key))
    per = {k: v / STEPS / 1e3 for k, v in by_kind.items()}
    print(f"== {name}: wall {wall * 1e3:.2f} ms/step, host backward {host / STEPS * 1e3:.2f} ms/step, "
          f"GPU ms/step " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())), flush=True)
    for t, count, key in sorted(rows, reverse=True)[:8]:
        print(f"   {t / STEPS / 1e3:8.3f} ms/step  x{count // STEPS:<5} {key[:110]}", flush=True)


def main():
    dist.init_process_group("smddp")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    nccl = dist.new_group(backend="nccl")
    x = torch.randn(16, 256, 1024, device=dev)
    m = build(dev)
    profile_variant("one GPU", m, m.parameters(), x, rank)
    for name, wrap in [
        ("torch DDP, nccl", lambda m: TorchDDP(m, device_ids=[dev.index], process_group=nccl)),
        ("torch DDP, smddp", lambda m: TorchDDP(m, device_ids=[dev.index])),
        ("torch DDP, nccl, bucket view", lambda m: TorchDDP(m, device_ids=[dev.index], process_group=nccl,
                                                            gradient_as_bucket_view=True)),
        ("smdistributed DDP fp32", lambda m: SmddpDDP(m)),
        ("smdistributed DDP bf16", lambda m: SmddpDDP(m, reduce_dtype=torch.bfloat16)),
    ]:
        w = wrap(build(dev))
        profile_variant(name, w, w.parameters(), x, rank)
        del w
        torch.cuda.empty_cache()
    # The reduction alone: 151M float32 values through NCCL (torch's group), timed.
    flat = torch.ones(sum(p.numel() for p in m.parameters()), device=dev)
    for dtype in (torch.float32, torch.bfloat16):
        t = flat.to(dtype)
        for _ in range(3):
            dist.all_reduce(t, group=nccl)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(t, group=nccl)
        torch.cuda.synchronize()
        if rank == 0:
            alone_ms = (time.perf_counter() - t0) / 5 * 1e3
            print(f"allreduce of all gradients alone, {dtype}: {alone_ms:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
