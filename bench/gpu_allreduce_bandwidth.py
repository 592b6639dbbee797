"""Allreduce bus bandwidth on GPUs: the smddp backend vs torch's NCCL backend, same run.

    smddprun -np 2 python bench/gpu_allreduce_bandwidth.py      (or torchrun --nproc_per_node 2)

Measured as the anchor script (../shared/anchors/anchor_collectives.py) measures NCCL:
float32 tensors of ones, synchronous dist.all_reduce calls back to back, torch.cuda.synchronize()
around the timed loop; bus bandwidth = algbw * 2(n-1)/n. Each size runs on both backends in
turn, `--rounds` times, and keeps each one's best round. Rank 0 prints the table and writes
bench/results/gpu_allreduce_<world>gpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

RESULTS = Path(__file__).resolve().parent / "results"


def time_allreduce(t, group, iters, warmup):
    for _ in range(warmup):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-log2", type=int, default=12)
    ap.add_argument("--max-log2", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("smddp")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    nccl = dist.new_group(backend="nccl")
    # A second smddp group without the argument checks (SMDDP_CUDA_CHECKS=0) shows their cost.
    os.environ["SMDDP_CUDA_CHECKS"] = "0"
    unchecked = dist.new_group(backend="smddp")
    del os.environ["SMDDP_CUDA_CHECKS"]
    groups = {"smddp": dist.group.WORLD, "nccl": nccl, "smddp_nochecks": unchecked}
    rows = []
    for k in range(args.min_log2, args.max_log2 + 1, 2):
        nbytes = 2 ** k
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        iters = 20 if nbytes >= 2 ** 26 else 100
        best = {name: float("inf") for name in groups}
        for _ in range(args.rounds):
            for name, g in groups.items():
                best[name] = min(best[name], time_allreduce(t, g, iters, 5))
        row = dict(bytes=nbytes)
        for name, s in best.items():
            algbw = nbytes / s / 1e9
            row[name] = dict(us=s * 1e6, algbw_GBs=algbw, busbw_GBs=algbw * 2 * (n - 1) / n)
        row["busbw_ratio"] = row["smddp"]["busbw_GBs"] / row["nccl"]["busbw_GBs"]
        row["extra_latency_us"] = row["smddp"]["us"] - row["nccl"]["us"]
        row["extra_latency_nochecks_us"] = row["smddp_nochecks"]["us"] - row["nccl"]["us"]
        rows.append(row)
        del t
    # Correctness of what was timed: one reduction of known values through smddp.
    check = torch.full((1024,), float(rank + 1), device=dev)
    dist.all_reduce(check)
    assert torch.all(check == n * (n + 1) / 2), check[:4]
    if rank == 0:
        print(f"allreduce float32, {n} GPUs ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"{'size':>8} {'smddp us':>10} {'nccl us':>10} {'smddp busbw':>12} {'nccl busbw':>11} "
              f"{'ratio':>6} {'extra us':>9} {'no-check us':>11} {'extra':>6}")
        for r in rows:
            b = r["bytes"]
            size = f"{b >> 20} MB" if b >= 2 ** 20 else f"{b >> 10} KB"
            print(f"{size:>8} {r['smddp']['us']:>10.1f} {r['nccl']['us']:>10.1f} {r['smddp']['busbw_GBs']:>12.1f} "
                  f"{r['nccl']['busbw_GBs']:>11.1f} {r['busbw_ratio']:>6.3f} {r['extra_latency_us']:>9.1f} "
                  f"{r['smddp_nochecks']['us']:>11.1f} {r['extra_latency_nochecks_us']:>6.1f}")
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"gpu_allreduce_{n}gpu.json"
        out.write_text(json.dumps(dict(
            command="smddprun -np %d python bench/gpu_allreduce_bandwidth.py" % n, world=n,
            device=torch.cuda.get_device_name(0), torch=torch.__version__,
            nccl=".".join(map(str, torch.cuda.nccl.version())), host=platform.node(), rows=rows), indent=1))
        print("wrote", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
