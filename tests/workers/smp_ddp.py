"""pp=2 x dp=2 data parallelism options against one process on the same batches.

  bpps2: backward_passes_per_step=2 (gradients accumulate over two steps, then one reduction
         and one optimizer step), overlapping_allreduce off.
  hook:  register_comm_hook(None, hook) with a hook that records each bucket and hands it to
         torch's own allreduce_hook; small buckets; overlapping_allreduce on (the default):
         the last stage's reduction must start inside the step.
Prints "DDP OK <mode> overlapped=<bool>"."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import smdistributed.modelparallel.torch as smp

MODE = sys.argv[1]
STEPS = 4


def build(seed=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
g = torch.Generator().manual_seed(6)
shards = [[(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]
          for _ in range(2)]

# The second replica starts from other weights: the parameters' broadcast over the
# data-parallel group at partition time must make them the first replica's.
start = build(5 if smp.dp_rank() == 0 else 99)
if MODE == "bpps2":
    model = smp.DistributedModel(start, backward_passes_per_step=2, overlapping_allreduce=False)
    every = 2
else:
    model = smp.DistributedModel(start, bucket_cap_mb=300 / 2**20)  # a bucket per ~300 bytes
    every = 1
    seen = []

    def recording_hook(group, bucket):
        seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters()), bucket.buffer().numel(),
                     sum(g.numel() for g in bucket.gradients())))
        return default_hooks.allreduce_hook(group, bucket)

    model.register_comm_hook(None, recording_hook)
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))


@smp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


overlapped = []
for step in range(STEPS):
    x, y = shards[smp.dp_rank()][step]
    train_step(model, x, y)
    if (step + 1) % every == 0:
        overlapped.append(model.last_reduction_overlapped)
        opt.step()
        opt.zero_grad()

ref = build()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
for step in range(STEPS):
    loss = sum(F.cross_entropy(ref(s[step][0]), s[step][1]) for s in shards) / 2
    loss.backward()
    if (step + 1) % every == 0:
        ref_opt.step()
        ref_opt.zero_grad()
full = model.state_dict()
for k, v in ref.state_dict().items():
    assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), (k, (full[k] - v).abs().max())

if MODE == "hook":
    local = list(model.local_parameters())
    per_step = len(seen) // STEPS
    assert per_step >= 2 and len(seen) == per_step * STEPS, seen
    for s in range(STEPS):
        rows = seen[s * per_step:(s + 1) * per_step]
        assert [r[0] for r in rows] == list(range(per_step)), rows
        assert [r[1] for r in rows] == [False] * (per_step - 1) + [True], rows
        assert sum(r[2] for r in rows) == len(local), rows
        assert all(r[3] == r[4] for r in rows), rows
print(f"DDP OK {MODE} pp_rank={smp.pp_rank()} overlapped={all(overlapped)}", flush=True)
