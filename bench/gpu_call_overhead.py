"""The host's cost of one collective call on CUDA tensors: torch's NCCL backend against
smddp (with and without its argument checks), the same tensors, in the same run.

    torchrun --nproc_per_node 2 bench/gpu_call_overhead.py

In a host-bound training step (the GPU waits for the host to issue work) every microsecond a
backend spends per call adds to the step. For each backend and tensor size, every rank issues
N asynchronous all_reduce calls back to back (as DDP's reducer does with its buckets, each
Work's future asked for) and then waits for them: 'issue' is the host's time per call until
the last call returned, 'done' the time per call until the GPU finished them all. Rank 0
prints the table and one 'RESULT {json}' line.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401


def group_without_checks():
    os.environ["SMDDP_CUDA_CHECKS"] = "0"  # read when the group is made
    group = dist.new_group(backend="smddp")
    del os.environ["SMDDP_CUDA_CHECKS"]
    return group


def measure(group, t, calls):
    for _ in range(20):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    futures = [dist.all_reduce(t, group=group, async_op=True).get_future() for _ in range(calls)]
    issued = time.perf_counter()
    for f in futures:
        f.wait()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - t0) / calls * 1e6, (done - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("smddp")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    groups = {"nccl": dist.new_group(backend="nccl"), "smddp": dist.group.WORLD,
              "smddp, no checks": group_without_checks()}
    sizes = {"4 KB": (1024, 400), "1 MB": (1 << 18, 200), "25 MB": (25 << 18, 40)}
    best = {}
    for _ in range(args.rounds):  # interleaved rounds, best of each: the host's speed drifts
        for gname, group in groups.items():
            for sname, (numel, calls) in sizes.items():
                t = torch.ones(numel, device="cuda")
                issue, done = measure(group, t, calls)
                key = f"{gname} | {sname}"
                old = best.get(key, (float("inf"), float("inf")))
                best[key] = (min(old[0], issue), min(old[1], done))
    if rank == 0:
        print(f"{dist.get_world_size()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        print(f"{'backend | size':<28} {'issue us/call':>14} {'done us/call':>13}")
        for key, (issue, done) in best.items():
            print(f"{key:<28} {issue:>14.1f} {done:>13.1f}")
        print("RESULT " + json.dumps({k: dict(issue_us=v[0], done_us=v[1]) for k, v in best.items()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
