"""Ranks that disagree, through torch.distributed on smddp: every rank raises, none hangs.

Usage: torch_errors.py CASE [SYNC_DIR]. Reports (report.py) a "raised" event per expected
error and "usable" once the group has been shown to still work. Deliberately ends without
destroy_process_group(), which must still exit cleanly.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from report import report
from torch_common import expect_error

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401


def main(case):
    dist.init_process_group(backend="smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    group = None
    if case == "missing_explicit_timeout":
        # A group with its own timeout (a short one passed to init_process_group would also
        # bound the rendezvous of ranks still starting up).
        group = dist.new_group(timeout=timedelta(seconds=3))
    if case == "shape":
        # Synchronous, then asynchronous through the future (as a DDP hook would see it).
        expect_error(lambda: dist.all_reduce(torch.zeros(4 + me)))
        expect_error(lambda: dist.all_reduce(torch.zeros(4 + me), async_op=True).get_future().wait())
        expect_error(lambda: dist.all_reduce(torch.zeros(4 + me), async_op=True).wait())
    elif case == "dtype":
        expect_error(lambda: dist.all_reduce(torch.zeros(4, dtype=torch.float32 if me == 0 else torch.float64)))
    elif case.startswith("missing"):
        # The last rank never joins one all_reduce: the others fail after the timeout, naming it,
        # while it waits (outside the backend) until they have.
        sync = sys.argv[2]
        if case != "missing_at_start":
            # Every rank starts the group's engine (its first collective); then one is missing.
            dist.all_reduce(torch.ones(1), group=group)
        if me != P - 1:
            expect_error(lambda: dist.all_reduce(torch.ones(4), group=group))
            open(os.path.join(sync, f"failed.{me}"), "w").close()
        else:
            while not all(os.path.exists(os.path.join(sync, f"failed.{r}")) for r in range(P - 1)):
                time.sleep(0.02)
            report("raised", message="(the missing rank)")
        if group is None:
            # Collectives are matched by their order in the group, which the missing call has
            # shifted on one rank; like NCCL or Gloo, the group is not usable after that.
            report("usable")
            return
        # The world group (another engine) is untouched by the sub-group's failure.
    else:
        raise SystemExit("unknown case " + case)
    # After a per-tensor error the group keeps working.
    x = torch.full((3,), float(me))
    work = dist.all_reduce(x, async_op=True)
    work.get_future().wait()
    assert torch.equal(x, torch.full((3,), float(sum(range(P))))), x
    report("usable")


if __name__ == "__main__":
    main(sys.argv[1])
