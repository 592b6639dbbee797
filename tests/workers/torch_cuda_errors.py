"""Bad calls on CUDA tensors raise on every rank, naming what is wrong, instead of hanging NCCL.

Usage: torch_cuda_errors.py shape | dtype | root | dead. Each rank prints "RAISED: <message>".
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


def main(case):
    dist.init_process_group(backend="smddp")
    use_test_device()
    me = dist.get_rank()
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
    print("RAISED:", first_error().replace("\n", " "), flush=True)
    os._exit(0)  # the communicator is aborted; nothing to tear down collectively


if __name__ == "__main__":
    main(sys.argv[1])
