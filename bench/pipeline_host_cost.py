"""The host's cost of a pipeline schedule: pp=2 over a model of negligible compute (16
Linear(16, 16), batch 64), smp "interleaved" against torch's Schedule1F1B on Gloo, in the same
run. Prints each rank's wall and CPU ms a step (CPU: every thread of the process) and CPU ms a
microbatch: the host work that bounds graphed GPU steps at 8 and 16 microbatches, measured
where no GPU is needed.

    torchrun --nproc_per_node 2 bench/pipeline_host_cost.py [--micro 16] [--seconds 10]
        [--only torch,smp] [--yappi STEPS]

--yappi STEPS profiles STEPS smp steps instead of timing them (yappi, CPU clock, every thread)
and writes the functions with the most time to pipeline_host_cost_yappi.rank<N>.txt.
On a 2-core machine step times vary by about 10% from run to run: compare over several runs.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import smdistributed.modelparallel.torch as smp
from pipeline_model import loss_fn, smp_sgd_step

p = argparse.ArgumentParser()
p.add_argument("--micro", type=int, default=16)
p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per configuration")
p.add_argument("--only", default="torch,smp")
p.add_argument("--active", type=int, default=2, help="smp's active_microbatches (1F1B keeps 2 on stage 0 at pp=2)")
p.add_argument("--yappi", type=int, default=0)
p.add_argument("--sleeps-by-thread", action="store_true", help="print each thread's sleeps a microbatch")
args = p.parse_args()
M = args.micro

smp.init({"partitions": 2, "microbatches": M, "pipeline": "interleaved", "active_microbatches": args.active})
rank = dist.get_rank()
gloo = dist.new_group(backend="gloo")
x, y = torch.randn(64, 16), torch.randn(64, 16)


def layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(16, 16) for _ in range(16)]


def profile(step):
    import yappi
    yappi.set_clock_type("cpu")
    yappi.start(builtins=True, profile_threads=True)
    for _ in range(args.yappi):
        step()
    yappi.stop()
    stats = yappi.get_func_stats()
    with open(f"pipeline_host_cost_yappi.rank{rank}.txt", "w") as f:
        for key in ("tsub", "ttot"):
            stats.sort(key)
            f.write(f"== by {key} (ms over {args.yappi} steps: self, total, calls)\n")
            for s in list(stats)[:80]:
                f.write(f"{s.tsub * 1e3:9.1f} {s.ttot * 1e3:9.1f} {s.ncall:8d} "
                        f"{s.module.split('site-packages/')[-1]}:{s.lineno} {s.name}\n")


def sleeps_by_thread():
    """Each live thread's sleeps so far (voluntary context switches), by native thread id: each
    is a wait that another thread's wake-up ended, the hand-offs a schedule makes."""
    import glob
    counts = {}
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            with open(status) as f:
                counts[int(status.split("/")[-2])] = sum(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except OSError:  # a thread that ended meanwhile
            pass
    return counts


def thread_names():
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            comm = "?"
        out[tid] = names.get(tid, f"native:{comm}")
    return out


def run(name, step):
    for _ in range(3):
        step()
    if args.yappi and name == "smp":
        return profile(step)
    dist.barrier(group=gloo)
    n, t0, c0, s0 = 0, time.perf_counter(), time.process_time(), sleeps_by_thread()
    while time.perf_counter() - t0 < args.seconds:
        step()
        n += 1
    # Every rank runs as many steps: they follow the pipeline, which the slowest paces.
    wall, cpu = (time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3
    s1 = sleeps_by_thread()
    delta = {tid: c - s0.get(tid, 0) for tid, c in s1.items()}
    sleeps = sum(delta.values()) / n / M
    if args.sleeps_by_thread:
        names = thread_names()
        for tid, d in sorted(delta.items(), key=lambda kv: -kv[1]):
            if d:
                print(f"  {name} rank {rank} {names.get(tid, tid)}: {d / n / M:.2f} sleeps a microbatch")
    print(f"{name} rank {rank}: {wall:.1f} ms a step, CPU {cpu:.1f} ms a step, {cpu / M:.2f} ms a microbatch, "
          f"{sleeps:.1f} thread sleeps a microbatch ({n} steps)", flush=True)


if "torch" in args.only:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    part = torch.nn.Sequential(*layers()[rank * 8:(rank + 1) * 8])
    sched = Schedule1F1B(PipelineStage(part, rank, 2, torch.device("cpu"), group=gloo), n_microbatches=M,
                         loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)

    def torch_step():
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()

    run("torch_1f1b", torch_step)

if "smp" in args.only:
    model = smp.DistributedModel(torch.nn.Sequential(*layers()), trace_device="cpu")
    run("smp", smp_sgd_step(smp, model, x, y))
