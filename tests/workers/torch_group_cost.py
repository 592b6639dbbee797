"""What a process group costs before and at its first use (3 ranks, CPU).

Eight smddp groups, as pipeline x data parallel makes (overlapping sub-groups and whole-world
ones), are created by every rank; creating them must start no thread (a group's engine,
sockets, shared memory and completion thread come with its first collective). Then each rank
runs one allreduce in each group it belongs to, checked against the sum over the members.
Prints "GROUP COST {json}" with the times and thread counts, and "GROUP COST OK".
"""
import json
import os
import time

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

MEMBERS = [[0, 1, 2], [0, 1], [1, 2], [0, 2], [0, 1, 2], [0], [1], [2]]


def threads() -> int:
    return len(os.listdir("/proc/self/task"))  # native threads too (engines, watchdogs)


def main():
    dist.init_process_group("smddp")
    me = dist.get_rank()
    dist.all_reduce(torch.ones(1))  # the world's engine is up: its threads are in the baseline
    before = threads()
    start = time.perf_counter()
    groups = [dist.new_group(m) for m in MEMBERS]
    created = time.perf_counter() - start
    after_create = threads()
    assert after_create == before, f"creating {len(MEMBERS)} groups started {after_create - before} threads"
    start = time.perf_counter()
    for members, g in zip(MEMBERS, groups):
        if me in members:
            x = torch.arange(6, dtype=torch.float32) + me
            dist.all_reduce(x, group=g)
            want = sum(torch.arange(6, dtype=torch.float32) + r for r in members)
            assert torch.equal(x, want), (members, x, want)
    first_use = time.perf_counter() - start
    report = {"groups": len(MEMBERS), "create_s": created, "first_use_s": first_use,
              "threads_before": before, "threads_after_create": after_create, "threads_after_use": threads(),
              "member_of": sum(me in m for m in MEMBERS)}
    print("GROUP COST " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print("GROUP COST OK", flush=True)


if __name__ == "__main__":
    main()
