"""Sibling groups of one split given the same store (as torch versions that named split
groups from a counter do): each half of the world must still get its own engine and
communicator. Ranks 0..P/2-1 and P/2..P-1 split, each sums over its half. Prints "SPLIT OK".
"""
import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from smdistributed.dataparallel.torch.process_group import smddp_group


def main():
    dist.init_process_group("smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    halves = [list(range(0, P // 2)), list(range(P // 2, P))]
    mine = next(h for h in halves if me in h)
    same_store = dist.PrefixStore("one-name-for-both/", dist.distributed_c10d._get_default_store())
    child = smddp_group(None)._split(same_store, mine, 30000)
    x = torch.arange(5, dtype=torch.float32) + me
    child.allreduce([x]).wait()
    want = sum(torch.arange(5, dtype=torch.float32) + r for r in mine)
    assert torch.equal(x, want), (mine, x, want)
    dist.barrier()
    print("SPLIT OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
