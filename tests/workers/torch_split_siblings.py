"""Splits whose store keys every member must agree on, on a 4-rank world (CPU):

1. The halves [0, 1] and [2, 3] split with one store, as torch versions that named split groups
   from a counter hand sibling groups: each half must get its own engine.
2. Only ranks 0 and 1 split [0, 1] again (torch versions that do not ask a rank outside every
   split group); then [0, 2] and [1, 3] split: their members have made different numbers of
   splits before, and must still meet.

Each new group sums over its members, checked element by element. Prints "SPLIT OK".
"""
import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from smdistributed.dataparallel.torch.process_group import smddp_group


def check_sum(child, members, me):
    x = torch.arange(5, dtype=torch.float32) + me
    child.allreduce([x]).wait()
    want = sum(torch.arange(5, dtype=torch.float32) + r for r in members)
    assert torch.equal(x, want), (members, x, want)


def main():
    dist.init_process_group("smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    world = smddp_group(None)
    default_store = dist.distributed_c10d._get_default_store()

    halves = [list(range(0, P // 2)), list(range(P // 2, P))]
    mine = next(h for h in halves if me in h)
    check_sum(world._split(dist.PrefixStore("one-name-for-both/", default_store), mine, 30000), mine, me)

    if me in halves[0]:  # the others are not asked
        check_sum(world._split(dist.PrefixStore("first-half-again/", default_store), halves[0], 30000),
                  halves[0], me)
    columns = [[r for r in range(P) if r % 2 == c] for c in (0, 1)]
    column = columns[me % 2]
    check_sum(world._split(dist.PrefixStore(f"columns-{me % 2}/", default_store), column, 30000), column, me)
    dist.barrier()
    print("SPLIT OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
