"""What each rank holds at its peak GPU memory in a pipeline step: torch's Schedule1F1B against
smp interleaved, same model and split, each block grouped by where it was allocated.

    torchrun --nproc_per_node 2 bench/pipeline_peak_memory.py --micro 4 --active 2

The pipeline benchmark's model (16 encoder layers d1024, bf16, batch 64 x 256), split evenly.
After 3 warm-up steps, one step runs under the allocator's history
(torch.cuda.memory._record_memory_history). The history is replayed to find the moment of the
step's peak; the blocks allocated during the step and alive then are summed by allocation site
(innermost frame outside torch, and the torch function under it). Blocks held from before the
step (parameters, gradients, and per-thread cuBLAS workspaces, counted as 32 MiB blocks) are
reported as one figure.
"""
import argparse
import collections
import gc
import os

import torch
import torch.distributed as dist

import smdistributed.modelparallel.torch as smp
from pipeline_model import smp_training_step, torch_1f1b_training_step

ap = argparse.ArgumentParser()
ap.add_argument("--micro", type=int, default=4)
ap.add_argument("--active", type=int, default=2)
ap.add_argument("--only", default="torch_1f1b,smp")
ap.add_argument("--top", type=int, default=12)
args = ap.parse_args()
D, L, B, S = 1024, 16, 64, 256
CUBLAS_WORKSPACE = 32 << 20


def site(frames):
    if not frames:
        return "(no Python frame: autograd's device thread or C++)"
    outside = next((f for f in frames if "/torch/" not in f["filename"]), None)
    inside = next((f for f in frames if "/torch/" in f["filename"]), None)
    where = f"{os.path.basename(outside['filename'])}:{outside['line']} {outside['name']}" if outside else "?"
    return where + (f" <- {inside['name']}" if inside else "")


def workspaces_held():
    """Active 32 MiB blocks: cuBLAS workspaces (one per thread that ran a matrix product)."""
    n = 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        n += sum(1 for b in seg["blocks"] if b["state"] == "active_allocated" and b["size"] == CUBLAS_WORKSPACE)
    return n


def analyse(name, step, rank):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    held_ws = workspaces_held()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    live, cur, best, at_best = {}, 0, 0, {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], site(ev.get("frames", [])))
            cur += ev["size"]
            if cur > best:
                best, at_best = cur, dict(live)
        elif ev["action"] == "free_requested":
            cur -= ev["size"]
            live.pop(ev["addr"], None)
    by_site = collections.defaultdict(lambda: [0, 0])
    for size, where in at_best.values():
        by_site[where][0] += size
        by_site[where][1] += 1
    lines = [f"[rank {rank}] {name}: held before the step {base / 2**30:.3f} GB ({held_ws} cuBLAS workspaces, "
             f"{held_ws * CUBLAS_WORKSPACE / 2**30:.3f} GB), peak {peak / 2**30:.3f} GB, "
             f"peak over held {(peak - base) / 2**30:.3f} GB (history: {best / 2**30:.3f} GB), alive at the peak:"]
    for where, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:args.top]:
        lines.append(f"    {size / 2**30:7.3f} GB  {n:5d} blocks  {where}")
    print("\n".join(lines), flush=True)


def main():
    m = args.micro
    pp = int(os.environ["WORLD_SIZE"])
    smp.init({"partitions": pp, "microbatches": m, "pipeline": "interleaved", "active_microbatches": args.active})
    rank = dist.get_rank()
    torch.cuda.set_device(smp.local_rank())
    dev = torch.device("cuda", smp.local_rank())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(dev, torch.bfloat16)
    y = torch.randn(B, S, D, generator=g).to(dev, torch.bfloat16)
    nccl = dist.new_group(backend="nccl")
    if "torch_1f1b" in args.only:
        analyse(f"torch_1f1b_m{m}", torch_1f1b_training_step(L, rank, pp, dev, nccl, m, x, y), rank)
        gc.collect()  # its stage and schedule, before smp's step is measured
        dist.barrier(group=nccl)
    if "smp" in args.only:
        _, smp_step = smp_training_step(smp, L, x, y)
        analyse(f"smp_interleaved_m{m}_a{args.active}", smp_step, rank)
    dist.barrier(group=nccl)


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()
