"""Where smp's step loses time against the plain model on one device (partitions 1, no peers).

    torchrun --nproc_per_node 1 bench/smp_overhead_profile.py [--micro 1]

The pipeline benchmark's model (16 encoder layers d1024, batch 64 x 256, bf16). For the plain
loop and for smp.step, prints wall ms per step, GPU kernel ms per step (busy), and the host
functions with the most self time in the smp step (torch profiler, 3 steps).
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import smdistributed.modelparallel.torch as smp

ap = argparse.ArgumentParser()
ap.add_argument("--micro", type=int, default=1)
args = ap.parse_args()
smp.init({"partitions": 1, "microbatches": args.micro})
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
D, H, F, L, B, S = 1024, 16, 4096, 16, 64, 256


def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(D, H, F, batch_first=True, dropout=0.0)
                                 for _ in range(L)])


x = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
y = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
loss_fn = lambda out, t: (out.float() - t.float()).pow(2).mean()  # noqa: E731
plain = layers().to(dev, torch.bfloat16)
plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
model = smp.DistributedModel(layers().to(torch.bfloat16))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))


@smp.step
def train_step(model, x, y):
    loss = loss_fn(model(x), y)
    model.backward(loss)
    return loss


def plain_step():
    plain_opt.zero_grad(set_to_none=True)
    loss_fn(plain(x), y).backward()
    plain_opt.step()


def smp_step():
    opt.zero_grad(set_to_none=True)
    train_step(model, x, y)
    opt.step()


for name, step in (("plain", plain_step), ("smp", smp_step)):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10
    host = []
    for _ in range(5):  # time to issue one step's work, the GPU idle at its start
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"== {name}: host time to issue a step {min(host) * 1e3:.2f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 3e3
    print(f"== {name}: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu:.2f} ms/step", flush=True)
    rows = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    for e in rows:
        print(f"   host self {e.self_cpu_time_total / 3e3:8.2f} ms/step  x{e.count // 3:<6} {e.key[:90]}", flush=True)
