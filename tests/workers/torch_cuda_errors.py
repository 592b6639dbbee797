"""Bad calls on CUDA tensors raise on every rank, naming what is wrong, instead of hanging NCCL.

Usage: torch_cuda_errors.py shape | dtype | root | dead | ahead | ahead-shape | shared-gpu. Each rank prints
"RAISED: <message>"; "ahead" (no error: one rank runs far ahead of the other) prints
"AHEAD OK deferred=<checks queued> waits=<checks the caller waited for>".
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch_common import use_test_device


def first_error(deadline_s=60.0) -> str:
    """Keeps making small collectives until the group reports its failure."""
    end = time.time() + deadline_s
    while time.time() < end:
        try:
            x = torch.ones(1)
            dist.all_reduce(x)
            torch.cuda.synchronize()
        except RuntimeError as e:
            return str(e)
        time.sleep(0.05)
    raise AssertionError("no error within the deadline")


def run_ahead(me, bad_call):
    """Rank 1 starts late, so rank 0 issues all its calls (many more than the 16 check names of a
    kind) before rank 1's first: rank 0's argument checks queue and its collectives go ahead.
    Every result is checked; a call whose shape differs (bad_call) must still raise everywhere."""
    from smdistributed.dataparallel.torch.process_group import smddp_group

    if me == 1:
        time.sleep(2.0)
    tensors, works = [], []
    try:
        for i in range(120):
            n = 1 + (i * 7919) % 5000 + (me if i == bad_call else 0)
            tensors.append(torch.full((n,), float(i + 1) * (me + 1)))
            works.append(dist.all_reduce(tensors[-1], async_op=True))
    except RuntimeError as e:  # the late rank may learn of the mismatch while still issuing
        if bad_call < 0:
            raise
        print("RAISED:", str(e).replace("\n", " "), flush=True)
        time.sleep(3)  # stay until the peer has its own error: exiting first would make it "rank died"
        os._exit(0)
    if bad_call >= 0:
        return
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    total = sum(r + 1 for r in range(dist.get_world_size()))
    for i, t in enumerate(tensors):
        assert torch.all(t == (i + 1) * total), f"call {i}: {t[:4].tolist()}, expected {(i + 1) * total}"
    nccl = smddp_group()._cuda_collectives.nccl
    print(f"AHEAD OK deferred={nccl.checks_deferred} waits={nccl.check_waits}", flush=True)
    dist.destroy_process_group()


def main(case):
    dist.init_process_group(backend="smddp")
    use_test_device()
    me = dist.get_rank()
    if case == "shared-gpu":  # every rank on one GPU (the test sets CUDA_VISIBLE_DEVICES)
        # The process group stages such collectives through host memory; the older API's
        # DistributedDataParallel makes its own NCCL communicator, and says why it cannot.
        from smdistributed.dataparallel.torch.parallel import DistributedDataParallel
        try:
            DistributedDataParallel(torch.nn.Linear(4, 4))
        except RuntimeError as e:
            print("RAISED:", str(e).replace("\n", " "), flush=True)
            dist.destroy_process_group()
            return
        raise AssertionError("the older DistributedDataParallel on two ranks of one GPU did not raise")
    dist.all_reduce(torch.ones(8))  # the communicator is up on every rank
    torch.cuda.synchronize()
    if case == "shape":
        dist.all_reduce(torch.ones(4 + me))
    elif case == "dtype":
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if me == 0 else torch.float64))
    elif case == "root":
        dist.broadcast(torch.ones(4), src=me)
    elif case == "dead":
        if me == 1:
            os._exit(3)
        dist.all_reduce(torch.ones(4))
    elif case == "ahead":
        run_ahead(me, -1)
        return
    elif case == "ahead-shape":
        run_ahead(me, 70)
    print("RAISED:", first_error().replace("\n", " "), flush=True)
    os._exit(0)  # the communicator is aborted; nothing to tear down collectively


if __name__ == "__main__":
    main(sys.argv[1])
