"""Where smp's step loses time against the plain model on one device (partitions 1, no peers).

    torchrun --nproc_per_node 1 bench/smp_overhead_profile.py [--micro 1] [--switch-interval S]
        [--trace smp_trace.json.gz]

The pipeline benchmark's model (16 encoder layers d1024, batch 64 x 256, bf16). For the plain
loop and for smp.step, prints wall ms per step, GPU kernel ms per step (busy), and the host
functions with the most self time in the smp step (torch profiler, 3 steps). --trace writes
the smp steps' profiler trace (Chrome format, gzipped; bench/gpu_idle_gaps.py reads it), and
--switch-interval sets Python's thread switch interval, to test whether handing the GIL
between the step's threads is where the GPU waits.
"""
import argparse
import gc
import gzip
import shutil
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import smdistributed.modelparallel.torch as smp
from pipeline_model import encoder_layers, loss_fn, smp_train_step

ap = argparse.ArgumentParser()
ap.add_argument("--micro", type=int, default=1)
ap.add_argument("--switch-interval", type=float, default=None)
ap.add_argument("--trace", default=None)
ap.add_argument("--gc-each-step", action="store_true", help="gc.collect() after every step")
ap.add_argument("--no-autograd-threads", action="store_true",
                help="run backward on the calling thread (torch.autograd.set_multithreading_enabled(False))")
args = ap.parse_args()
if args.switch_interval is not None:
    sys.setswitchinterval(args.switch_interval)
if args.no_autograd_threads:
    torch.autograd.set_multithreading_enabled(False)
print(f"== thread switch interval {sys.getswitchinterval() * 1e3:.2f} ms", flush=True)
smp.init({"partitions": 1, "microbatches": args.micro})
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
D, H, F, L, B, S = 1024, 16, 4096, 16, 64, 256


def layers():
    return torch.nn.Sequential(*encoder_layers(L, D, H, F))


x = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
y = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
plain = layers().to(dev, torch.bfloat16)
plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
model = smp.DistributedModel(layers().to(torch.bfloat16))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))


train_step = smp_train_step(smp)


def plain_step():
    plain_opt.zero_grad(set_to_none=True)
    loss_fn(plain(x), y).backward()
    plain_opt.step()


def smp_step():
    opt.zero_grad(set_to_none=True)
    train_step(model, x, y)
    opt.step()


def with_gc(step):
    def run():
        step()
        gc.collect()
    return run


if args.gc_each_step:
    plain_step, smp_step = with_gc(plain_step), with_gc(smp_step)

for name, step in (("plain", plain_step), ("smp", smp_step)):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10
    after = torch.cuda.memory_stats()
    # Allocator retries free every cached block (a device-wide synchronisation) to satisfy a
    # request; device allocations are cudaMalloc calls: either stalls the host mid-step.
    print(f"== {name}: over 10 steps, allocator retries {after['num_alloc_retries'] - before['num_alloc_retries']}, "
          f"cudaMalloc {after['num_device_alloc'] - before['num_device_alloc']}, "
          f"cudaFree {after['num_device_free'] - before['num_device_free']}, "
          f"reserved {after['reserved_bytes.all.current'] / 2**30:.1f} GiB, "
          f"peak allocated {after['allocated_bytes.all.peak'] / 2**30:.1f} GiB", flush=True)
    host = []
    for _ in range(5):  # time to issue one step's work, the GPU idle at its start
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"== {name}: host time to issue a step {min(host) * 1e3:.2f} ms", flush=True)
    # Step by step, back to back: GPU time between step starts (events) and host time per call.
    torch.cuda.synchronize()
    marks, calls = [], []
    for _ in range(12):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)
        t0 = time.perf_counter()
        step()
        calls.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    gpu_steps = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    print(f"== {name}: per step, GPU ms " + " ".join(f"{g:.0f}" for g in gpu_steps) + " | host ms " +
          " ".join(f"{c * 1e3:.0f}" for c in calls), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        profiled = (time.perf_counter() - t0) / 3
    print(f"== {name}: wall under the profiler {profiled * 1e3:.2f} ms/step", flush=True)
    if args.trace and name == "smp":
        prof.export_chrome_trace(args.trace + ".raw")
        with open(args.trace + ".raw", "rb") as src, gzip.open(args.trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 3e3
    print(f"== {name}: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu:.2f} ms/step", flush=True)
    rows = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    for e in rows:
        print(f"   host self {e.self_cpu_time_total / 3e3:8.2f} ms/step  x{e.count // 3:<6} {e.key[:90]}", flush=True)
