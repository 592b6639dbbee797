"""DistributedModel.join(): pp=2 x dp=2 where replica 0 has 3 batches and replica 1 has 2.
Compared with one process: steps 1-2 average both replicas' gradients; step 3 has replica 0's
gradient divided by the 2 replicas (torch DDP's join default). Prints "JOIN OK"."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp


def build():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
g = torch.Generator().manual_seed(6)
shards = [[(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
          for _ in range(2)]
shards[1] = shards[1][:2]  # replica 1 runs out of batches one step early

model = smp.DistributedModel(build())
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))


@smp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


with model.join():
    for x, y in shards[smp.dp_rank()]:
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()

ref = build()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
for step in range(3):
    ref_opt.zero_grad()
    loss = sum(F.cross_entropy(ref(s[step][0]), s[step][1]) for s in shards if step < len(s)) / 2
    loss.backward()
    ref_opt.step()
full = model.state_dict()
for k, v in ref.state_dict().items():
    assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), k

# After the join, the replicas (3 and 2 steps run) train on together: one more step, outside
# join, on a batch both replicas share, averages as any step does.
x, y = shards[0][0]
opt.zero_grad()
train_step(model, x, y)
opt.step()
ref_opt.zero_grad()
F.cross_entropy(ref(x), y).backward()
ref_opt.step()
full = model.state_dict()
for k, v in ref.state_dict().items():
    assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), k
print("JOIN OK", flush=True)
