"""smp on one GPU (partitions 1): fp16 autocast with smp.amp.GradScaler against torch's own
scaler on the same GPU, an injected inf skipped, bf16 autocast reaching the model, and a
partial save/load round trip of the model and Adam state held on the GPU. argv: directory.
Prints "GPU SINGLE OK"."""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp


def build():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


smp.init({"partitions": 1, "microbatches": 2})
torch.cuda.set_device(smp.local_rank())
dev = torch.device("cuda", smp.local_rank())
g = torch.Generator().manual_seed(4)
data = [(torch.randn(16, 32, generator=g).to(dev), torch.randint(0, 4, (16,), generator=g).to(dev)) for _ in range(4)]

ref = build().to(dev)
ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
ref_scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
model = smp.DistributedModel(build())
opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
scaler = smp.amp.GradScaler(init_scale=256.0)


@smp.step
def train_step(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
    loss = F.cross_entropy(out.float(), y)
    model.backward(scaler.scale(loss))
    return out


for step, (x, y) in enumerate(data):
    opt.zero_grad()
    train_step(model, x, y)
    assert next(model.local_parameters()).is_cuda
    if step == 2:
        next(model.local_parameters()).grad[0].fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    if step == 2:
        assert scaler.get_scale() == ref_scaler.get_scale() / 2, (scaler.get_scale(), ref_scaler.get_scale())
        ref_scaler.update(ref_scaler.get_scale() / 2)  # the reference skips the same step
        continue
    ref_opt.zero_grad()
    for mb in range(2):  # the same two microbatches, gradients averaged over them
        sl = slice(mb * 8, (mb + 1) * 8)
        with torch.autocast("cuda", dtype=torch.float16):
            out = ref(x[sl])
        ref_scaler.scale(F.cross_entropy(out.float(), y[sl]) / 2).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    for k, v in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v.cpu(), rtol=1e-4, atol=1e-5), (step, k)


@smp.step
def bf16_step(model, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(x)


assert bf16_step(model, data[0][0]).outputs[0].dtype == torch.bfloat16

path = os.path.join(sys.argv[1], "ckpt.pt")
smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, path, partial=True)
saved = {k: v.clone() for k, v in model.state_dict().items()}
saved_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
with torch.no_grad():
    for p in model.local_parameters():
        p.add_(1.0)
opt.state.clear()
state = smp.load(path, partial=True)
model.load_state_dict(state["model"])
opt.load_state_dict(state["opt"])
assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
for i, s in opt.state_dict()["state"].items():
    for k, v in s.items():
        assert torch.equal(v.cpu(), saved_opt[i][k].cpu()), (i, k)
for p in model.local_parameters():  # the live state sits with its parameter, on the GPU
    assert all(k == "step" or v.is_cuda for k, v in opt.state[p].items()), \
        {k: v.device for k, v in opt.state[p].items()}
print("GPU SINGLE OK", flush=True)
