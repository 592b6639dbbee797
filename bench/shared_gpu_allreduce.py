"""Allreduce of CUDA tensors among ranks that share one GPU: smddp (which stages such groups'
collectives through host memory, frontends/torch/host_staging.py) against gloo (which stages
CUDA tensors through the host too), same run. NCCL cannot run there at all.

    CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 3 bench/shared_gpu_allreduce.py

float32 tensors, synchronous dist.all_reduce calls back to back, torch.cuda.synchronize()
around each timed loop; each size runs on both backends in turn, `--rounds` times, keeping
each one's best round. Every rank checks the last result of each size. Rank 0 prints the table
and writes bench/results/shared_gpu_allreduce_<world>ranks.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from gpu_allreduce_bandwidth import time_allreduce  # the same timed loop as the NCCL comparison

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-log2", type=int, default=12)
    ap.add_argument("--max-log2", type=int, default=26)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # smddp's one warning that the ranks share a GPU
    dist.init_process_group("smddp")
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    groups = {"smddp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rows = []
    for k in range(args.min_log2, args.max_log2 + 1, 2):
        nbytes = 2 ** k
        iters = 10 if nbytes >= 2 ** 24 else 50
        best = {name: float("inf") for name in groups}
        for _ in range(args.rounds):
            for name, g in groups.items():
                t = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
                best[name] = min(best[name], time_allreduce(t, g, iters, 3))
        for name, g in groups.items():  # what was timed gives the right answer
            t = torch.full((nbytes // 4,), float(rank + 1), device=dev)
            dist.all_reduce(t, group=g)
            assert torch.all(t == n * (n + 1) / 2), (name, nbytes, t[:4])
        rows.append(dict(bytes=nbytes, smddp_us=best["smddp"] * 1e6, gloo_us=best["gloo"] * 1e6,
                         gloo_over_smddp=best["gloo"] / best["smddp"]))
    if rank == 0:
        print(f"allreduce float32 on CUDA, {n} ranks on one {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        print(f"{'size':>8} {'smddp us':>10} {'gloo us':>10} {'gloo/smddp':>11}")
        for r in rows:
            b = r["bytes"]
            size = f"{b >> 20} MB" if b >= 2 ** 20 else f"{b >> 10} KB"
            print(f"{size:>8} {r['smddp_us']:>10.1f} {r['gloo_us']:>10.1f} {r['gloo_over_smddp']:>11.2f}")
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"shared_gpu_allreduce_{n}ranks.json"
        out.write_text(json.dumps(dict(
            command=f"CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node {n} bench/shared_gpu_allreduce.py",
            world=n, device=torch.cuda.get_device_name(0), torch=torch.__version__, host=platform.node(),
            rows=rows), indent=1))
        print("wrote", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
