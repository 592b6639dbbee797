"""torch DDP on smddp when a peer dies or stalls mid-training: every surviving rank's
backward (or the optimizer step after it) raises a RuntimeError naming the failure, within
the timeout, instead of crashing or hanging.

usage: torch_ddp_faults.py dead|stalled   (the last rank is the one that fails)
Survivors report "raised" {after_s, message} (report.py). With SMDDP_TEST_DEVICE=cuda each
rank trains on its GPU (NCCL through smddp), reading the loss each step as training loops
that log it do, so the host meets the failure within a step.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from report import report

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401


def main(case):
    dist.init_process_group("smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    device = torch.device("cpu")
    if os.environ.get("SMDDP_TEST_DEVICE") == "cuda":
        device = torch.device("cuda", me % torch.cuda.device_count())  # one rank per GPU
        torch.cuda.set_device(device)
    model = model.to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    victim = P - 1
    for step in range(1000):
        if step == 3 and me == victim:
            if case == "dead":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)  # stalled: alive, sockets open, silent
        t0 = time.monotonic()
        try:
            opt.zero_grad()
            loss = ddp(torch.randn(8, 32, device=device)).sum()
            loss.backward()
            opt.step()
            loss.item()
        except RuntimeError as e:
            report("raised", after_s=time.monotonic() - t0, message=str(e).splitlines()[0])
            os._exit(0)  # the group is gone; leave without a goodbye to the stopped peer
    raise AssertionError("training went on past the failure")


if __name__ == "__main__":
    main(sys.argv[1])
