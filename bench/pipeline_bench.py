"""Pipeline parallelism: smp (simple and interleaved) against torch.distributed.pipelining
(GPipe, 1F1B) with the same split, and the whole model on one device, in the same run.

    torchrun --nproc_per_node 2 bench/pipeline_bench.py                     # 2 GPUs
    torchrun --nproc_per_node 2 bench/pipeline_bench.py --device cpu --small # 2 CPU processes, Gloo peer
    torchrun --nproc_per_node 1 bench/pipeline_bench.py --only single,smp --act-ckpt  # one GPU, memory
    torchrun --nproc_per_node 2 bench/pipeline_bench.py --device cpu --tiny  # the schedules' host cost
    torchrun --nproc_per_node 4 bench/pipeline_bench.py --dp 2 --only single,torch,smp,ddp  # pp=2 x dp=2

The number of partitions is the number of processes over `--dp`. With `--dp 2` every
pipeline is a data-parallel replica: smp runs with `ddp: true`, and torch's pipeline stages
average their gradients over the replicas in one flat allreduce after the schedule (see
average_over). `ddp` in `--only` times the whole model under torch DDP over NCCL on every
process (one replica per device). Every replica takes its own batch of B samples, so a
step processes B x replicas samples, and the speedup is in samples/s over one device's.
Model (GPU): 16 TransformerEncoderLayers (width 1024, 16 heads, ffn 4096), bf16 parameters,
batch 64 x 256, loss = mean square of the output, SGD; split 8 + 8 (the anchor's setup).
Prints one 'RESULT {json}' line on rank 0: step time, samples/s, speedup over one device
(ideal P*m/(m+P-1)), idle fraction 1 - speedup/P (bubble plus overheads), peak memory per rank,
and each rank's CPU time a step (cpu_ms: all the process's threads, the host's work); rank 0's
min, median and max time between two step returns (step_spread_ms: whether a slow run is slow
at every step or at some).

Peak memory: on GPUs, torch's max_memory_allocated over the warm-up and timed steps
(peak_gb; the warm-up holds the stage graphs' captures) and over the timed steps alone
(steady_peak_gb); with `--graphs`, each rank's reserved GB after the timed steps split by pool
(graphs.reserved_gb: forward, backward, other; see reserved_by_pool). On CPUs (`--memory`),
the most a step adds to the process's resident memory (sampled every 0.5 ms over two extra,
untimed steps, from just before the step): activations, gradients and transfers. Run it with
MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors go back to the system (glibc otherwise
raises the threshold and keeps them), or the figure is the allocator's high-water mark.

`--active 2,4` also times smp "interleaved" with those `active_microbatches` (suffix _a2, _a4);
the default is the original's, partitions + 2; `partitions` holds as many microbatches in
flight on the first stage as torch's 1F1B.
"""
import argparse
import collections
import dataclasses
import gc
import json
import os
import threading
import time

import torch
import torch.distributed as dist

import smdistributed.modelparallel.torch as smp
from pipeline_model import encoder_layers, loss_fn, smp_train_step


def host_delay(spec: str):
    """--host-delay's function: spins the microseconds given for this pipeline rank, if any."""
    delays = dict(tuple(int(v) for v in item.split(":")) for item in spec.split(",") if item)
    if not delays:
        return None

    def delay():
        us = delays.get(smp.pp_rank(), 0)
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    return delay


p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--small", action="store_true", help="8 layers of width 256, batch 32 x 64 (for CPUs)")
p.add_argument("--tiny", action="store_true",
               help="16 layers of width 64, batch 64 x 16: compute is negligible, so the step time is the host's "
                    "cost of running the schedule (what bounds the GPU runs at 8 and 16 microbatches)")
p.add_argument("--micro", default="4,8,16")
p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (partitions = processes / dp)")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--only", default="single,torch,smp")
p.add_argument("--pipelines", default="simple,interleaved")
p.add_argument("--act-ckpt", action="store_true",
               help="also time smp with every layer under smp.set_activation_checkpointing (suffix _ckpt)")
p.add_argument("--graphs", action="store_true",
               help="also time smp with its stages replayed as CUDA graphs (SMDDP_SMP_CUDA_GRAPHS; suffix _graphs)")
p.add_argument("--no-eager", action="store_true", help="with --graphs: time the graphed runs only")
p.add_argument("--active", default="", help="also time smp interleaved with these active_microbatches")
p.add_argument("--memory", action="store_true", help="CPU: sample each step's peak resident memory (see above)")
p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
p.add_argument("--gc", choices=["on", "freeze", "off"], default="on",
               help="Python's garbage collector during the timed steps: as usual, with every object "
                    "that exists after the warm-up frozen out of its collections (gc.freeze), or "
                    "disabled (whether its pauses show in the step times)")
p.add_argument("--host-delay", default="",
               help="RANK:US[,RANK:US]: smp only, pipeline rank RANK's step function spins US microseconds "
                    "of Python (holding the GIL) after each microbatch's loss. Which rank's host bounds "
                    "the step shows as the step time growing by about m x US when that rank is delayed, "
                    "and not when the other is (a causal profile)")
args = p.parse_args()
if args.switch_interval is not None:
    import sys
    sys.setswitchinterval(args.switch_interval)
D, H, F, L, B, S = ((256, 8, 1024, 8, 32, 64) if args.small else (64, 4, 256, 16, 64, 16) if args.tiny
                    else (1024, 16, 4096, 16, 64, 256))
DTYPE = torch.float32 if args.device == "cpu" else torch.bfloat16


def layers(n):
    return encoder_layers(n, D, H, F)


def sync():
    if args.device == "cuda":
        torch.cuda.synchronize()


def peak_reset():
    # Objects of the configurations timed before (torch's pipeline stages hold reference
    # cycles) are collected first, so that a configuration's peak holds only its own memory.
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        held_before[0] = torch.cuda.memory_allocated() / 2**30
        warmup_peaks[:] = [0.0, 0.0]


held_before = [0.0]  # GB allocated when the configuration started: its model, inputs, leftovers
warmup_peaks = [0.0, 0.0]  # GB allocated / reserved at most in the warm-up steps (captures happen there)


def peak_gb():
    """The most allocated over the warm-up and timed steps."""
    return max(warmup_peaks[0], torch.cuda.max_memory_allocated() / 2**30) if args.device == "cuda" else 0.0


def reserved_by_pool(graphs):
    """GB the allocator reserves now, split by pool: the stage graphs' forward pools (one per
    instance), their shared backward pool, and the rest ("other": the general pool, where eager
    work, parameters, gradients and messages live). Graph pools hold a replay's activations and
    temporaries, which max_memory_allocated does not count between replays."""
    labels = graphs.pool_labels()
    split = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        split[labels.get(tuple(segment.get("segment_pool_id", (0, 0))), "other")] += segment["total_size"]
    return {k: round(v / 2**30, 3) for k, v in sorted(split.items())}


def end_warmup_peaks():
    """Keeps the warm-up's peaks and starts the timed steps' own (the steady state's)."""
    if args.device == "cuda":
        warmup_peaks[:] = [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30]
        torch.cuda.reset_peak_memory_stats()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step_rss_peak_gb(step, rank_sync, steps=2):
    """The most one step adds to resident memory (CPU runs; see the module's doc)."""
    worst = 0
    for _ in range(steps):
        rank_sync()
        base = rss_bytes()
        high = [base]
        done = threading.Event()

        def sample():
            while not done.is_set():
                high[0] = max(high[0], rss_bytes())
                time.sleep(0.0005)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        step()
        done.set()
        t.join()
        worst = max(worst, high[0] - base)
    return worst / 2**30


last_cpu_ms = [0.0]  # the process's CPU time (all its threads) per timed step, of the last timed()
last_spread = [[]]  # this rank's host time between step returns of the last timed(): min, median, max ms


def timed(step, rank_sync):
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync()
            end_warmup_peaks()
            if args.gc != "on":
                gc.collect()
            if args.gc == "freeze":
                gc.freeze()
            elif args.gc == "off":
                gc.disable()
            rank_sync()
            t0, c0 = time.perf_counter(), time.process_time()
            returns = [t0]
        step()
        if i >= args.warmup:
            returns.append(time.perf_counter())
    sync()
    gc.unfreeze()
    gc.enable()
    last_cpu_ms[0] = (time.process_time() - c0) / args.steps * 1e3
    gaps = sorted(b - a for a, b in zip(returns, returns[1:]))
    last_spread[0] = [round(gaps[0] * 1e3, 1), round(gaps[len(gaps) // 2] * 1e3, 1), round(gaps[-1] * 1e3, 1)]
    return (time.perf_counter() - t0) / args.steps


def average_over(group, params):
    """The peer's data parallelism across pipelines: the stage's gradients averaged in one
    flat allreduce after the schedule. (torch DDP around a stage, which the schedules support,
    left the last stage's replicas with different gradients in torch 2.13: checked on Gloo.)"""
    replicas = dist.get_world_size(group)
    if replicas == 1:
        return
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(replicas)
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def peer_groups_like(group, backend, world_group):
    """A group of `backend` over the ranks of `group` (one of smp's), made on every rank."""
    mine = dist.get_process_group_ranks(group)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=world_group)
    made = {}
    for ranks in sorted({tuple(r) for r in everyone}):  # every rank creates every group, in one order
        made[ranks] = dist.new_group(list(ranks), backend=backend)
    return made[tuple(mine)]


def main():
    pp = int(os.environ.get("WORLD_SIZE", "2")) // args.dp
    smp.init({"partitions": pp, "microbatches": 4, "ddp": args.dp > 1})
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(smp.local_rank())
        dev = torch.device("cuda", smp.local_rank())
    else:
        dev = torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(dev, DTYPE)
    y = torch.randn(B, S, D, generator=g).to(dev, DTYPE)
    out = dict(world=world, pp=pp, dp=args.dp, torch=torch.__version__,
               model=f"{L} encoder layers d{D} ffn{F}, batch {B}x{S} per replica, {DTYPE}",
               device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    peer_backend = "nccl" if args.device == "cuda" else "gloo"
    peer_group = dist.new_group(backend=peer_backend)
    cpu_group = dist.new_group(backend="gloo") if peer_backend != "gloo" else peer_group  # CPU figures
    # The peer's pipeline and replica groups: the ranks of smp's, on the peer's backend.
    peer_pp, peer_dp = (peer_groups_like(g, peer_backend, peer_group)
                        for g in (smp.get_pp_process_group(), smp.get_dp_process_group()))
    pp_rank = smp.pp_rank()
    barrier = lambda: dist.barrier(group=peer_group)  # noqa: E731
    micro = [int(m) for m in args.micro.split(",")]
    single = None

    def record(name, t, m, peaks, replicas=args.dp, extra=None):
        """m: microbatches (None: no pipeline); replicas: batches of B samples per step."""
        peaks, held, reserved, steady, steady_reserved = peaks
        # The host's work: CPU ms a step on each rank, every thread of the process (a busy
        # wait counts too). On GPUs, what bounds a step when kernels are short.
        cpu = torch.tensor([last_cpu_ms[0]])
        cpus = [torch.zeros_like(cpu) for _ in range(world)]
        dist.all_gather(cpus, cpu, group=cpu_group)
        entry = dict(step_ms=t * 1e3, samples_s=replicas * B / t, peak_gb=peaks,
                     cpu_ms=[round(c.item(), 2) for c in cpus], step_spread_ms=last_spread[0], **(extra or {}))
        if args.device == "cuda":
            entry["held_before_gb"] = held
            # Reserved counts what graph pools hold between replays (allocated does not).
            entry["peak_reserved_gb"] = reserved
            # The timed steps alone: without the warm-up's eager runs and graph captures.
            entry["steady_peak_gb"], entry["steady_reserved_gb"] = steady, steady_reserved
        if single:
            speedup = replicas * single / t
            ideal = replicas * (pp * m / (m + pp - 1) if m else 1)
            entry.update(speedup_vs_single=speedup, ideal=ideal, idle_fraction=1 - speedup / world)
        out[name] = entry
        if rank == 0:
            print(name, json.dumps(entry), flush=True)

    def all_peaks(step=None):
        value = peak_gb()
        if args.device == "cpu" and args.memory and step is not None:
            value = step_rss_peak_gb(step, barrier)
        steady = [0.0, 0.0]
        reserved = 0.0
        if args.device == "cuda":
            steady = [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30]
            reserved = max(warmup_peaks[1], steady[1])
        t = torch.tensor([value, held_before[0], reserved] + steady, device=dev if args.device == "cuda" else "cpu")
        ts = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(ts, t, group=peer_group)
        # peak, held before, reserved peak, and the timed steps' own allocated and reserved peaks
        return tuple([v[i].item() for v in ts] for i in range(5))

    def whole_model_step(wrap=lambda m: m):
        """A training step of the whole model (wrapped, for DDP), its memory peak reset."""
        model = wrap(torch.nn.Sequential(*layers(L)).to(dev, DTYPE))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        peak_reset()

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

        return step

    if "single" in args.only:
        single = timed(whole_model_step(), barrier)
        out["single"] = dict(step_ms=single * 1e3, samples_s=B / single, peak_gb=peak_gb())
        if rank == 0:
            print("single", json.dumps(out["single"]), flush=True)

    if "ddp" in args.only and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        step = whole_model_step(lambda m: DistributedDataParallel(
            m, device_ids=[dev.index] if args.device == "cuda" else None, process_group=peer_group))
        record(f"torch_ddp_{peer_backend}", timed(step, barrier), None, all_peaks(step), replicas=world)
        del step

    if "torch" in args.only and pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        for name, Sched in (("torch_gpipe", ScheduleGPipe), ("torch_1f1b", Schedule1F1B)):
            for m in micro:
                per = L // pp
                part = torch.nn.Sequential(*layers(L)[pp_rank * per:(pp_rank + 1) * per]).to(dev, DTYPE)
                stage = PipelineStage(part, pp_rank, pp, dev, group=peer_pp)
                sched = Sched(stage, n_microbatches=m, loss_fn=loss_fn)
                opt = torch.optim.SGD(part.parameters(), lr=1e-3)
                peak_reset()

                def step():
                    opt.zero_grad(set_to_none=True)
                    if pp_rank == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y, losses=[])
                    average_over(peer_dp, list(part.parameters()))
                    opt.step()

                t = timed(step, barrier)
                record(f"{name}_m{m}", t, m, all_peaks(step))
                del part, stage, sched, opt

    if "smp" in args.only:
        model = smp.DistributedModel(torch.nn.Sequential(*layers(L)).to(DTYPE),
                                     trace_device="gpu" if args.device == "cuda" else "cpu")
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        train_step = smp_train_step(smp, host_delay(args.host_delay))
        base = smp._state.cfg
        suffixes = ([] if args.no_eager and args.graphs else [""]) + (["_graphs"] if args.graphs else []) + \
            (["_ckpt"] if args.act_ckpt else [])
        if args.graphs and args.no_eager:
            # The runtime is made at the first step, with graphs on only if the variable says so:
            # without it the first configuration ran eagerly (session 25's m = 4 figures).
            os.environ["SMDDP_SMP_CUDA_GRAPHS"] = "1"
        for suffix in suffixes:
            if suffix == "_ckpt":  # every encoder layer keeps only its input; activations recomputed in backward
                smp.set_activation_checkpointing(model.module, strategy="each")
            runs = [(pipeline, None) for pipeline in args.pipelines.split(",")]
            runs += [("interleaved", int(a)) for a in args.active.split(",") if a]
            for pipeline, active in runs:
                for m in micro:
                    smp._state.cfg = dataclasses.replace(base, microbatches=m, pipeline=pipeline,
                                                         active_microbatches=active or base.active_microbatches)
                    # The previous configuration's gradients go first, as the step would free
                    # them: torch's stages start each configuration without any, and
                    # held_before_gb compares what the runtimes keep, not the gradients.
                    opt.zero_grad(set_to_none=True)
                    if args.graphs and model._runtime is not None:  # the runtime exists after the first step
                        graphs = model._runtime.graphs
                        graphs.clear()  # the previous configuration's graphs and their pools
                        graphs.enabled = suffix == "_graphs"
                    peak_reset()

                    def step():
                        opt.zero_grad(set_to_none=True)
                        train_step(model, x, y)
                        opt.step()

                    before = dict(model._runtime.graphs.counters) if model._runtime is not None else {}
                    name = f"smp_{pipeline}_m{m}" + (f"_a{active}" if active else "") + suffix + \
                        (f"_delay{args.host_delay.replace(':', 'r').replace(',', '_')}" if args.host_delay else "")
                    t = timed(step, barrier)
                    extra = None
                    if suffix == "_graphs":  # each rank's replays and captures in this configuration, as evidence
                        mine = {k: v - before.get(k, 0) for k, v in model._runtime.graphs.counters.items()}
                        mine["reserved_gb"] = reserved_by_pool(model._runtime.graphs)
                        ranks = [None] * world
                        dist.all_gather_object(ranks, mine, group=peer_group)
                        extra = dict(graphs=ranks)
                    record(name, t, m, all_peaks(step), extra=extra)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    # Torch's Gloo groups left to interpreter exit can abort it (a Gloo thread frees a work
    # holding Python tensors during finalization): end them first.
    torch.distributed.destroy_process_group()
