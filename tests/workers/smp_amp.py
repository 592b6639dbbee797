"""smp.amp.GradScaler: an inf injected into one stage's gradients makes every rank skip the
step and halve the scale; other steps match one process with torch's GradScaler.
Prints "AMP OK" on success."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp


def build():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
g = torch.Generator().manual_seed(4)
data = [(torch.randn(8 * smp.dp_size(), 8, generator=g), torch.randint(0, 4, (8 * smp.dp_size(),), generator=g))
        for _ in range(3)]

ref = build()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
model = smp.DistributedModel(build())
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
scaler = smp.amp.GradScaler(init_scale=256.0)


@smp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(scaler.scale(loss))
    return loss


for step, (x, y) in enumerate(data):
    shard = slice(smp.dp_rank() * 8, (smp.dp_rank() + 1) * 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    train_step(model, x[shard], y[shard])
    if step == 1 and smp.pp_rank() == 1 and smp.dp_rank() == 0:
        next(model.local_parameters()).grad[0].fill_(float("inf"))  # one stage of one replica
    scaler.step(opt)
    scaler.update()
    after = model.state_dict()
    if step == 1:
        assert all(torch.equal(before[k], after[k]) for k in after), "a rank stepped over an inf"
        assert scaler.get_scale() == 128.0, scaler.get_scale()
    else:
        ref_opt.zero_grad()
        ref_scaler.scale(F.cross_entropy(ref(x), y)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        for k, v in ref.state_dict().items():
            assert torch.allclose(after[k], v, rtol=1e-5, atol=1e-6), (step, k)
print("AMP OK", scaler.get_scale(), flush=True)
