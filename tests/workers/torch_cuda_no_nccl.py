"""A CUDA tensor on smddp when NCCL cannot be loaded: a clear error naming what is missing."""
import torch
import torch.distributed as dist
from torch_common import expect_raises, use_test_device

dist.init_process_group(backend="smddp")
use_test_device()
expect_raises(lambda: dist.all_reduce(torch.ones(4)), RuntimeError, "NCCL", "SMDDP_NCCL_LIBRARY")
x = torch.ones(4, device="cpu")
dist.all_reduce(x)  # the CPU path is unaffected
assert x.tolist() == [1.0] * 4
dist.destroy_process_group()
print("NO NCCL OK", flush=True)
