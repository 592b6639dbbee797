"""Where each rank's host time goes in a pipeline benchmark: wraps the pipeline runtime's own
functions (and a few of torch's and the backend's) with timers, runs a benchmark script
unchanged under them, and prints per rank, for each function, its calls, mean wall and mean
thread CPU microseconds, and total wall.

    torchrun --nproc_per_node 2 bench/smp_host_probe.py [--all-steps] \\
        bench/pipeline_bench.py --pipelines interleaved --graphs --no-eager --only smp --micro 8

Counts the timed steps of the benchmark's first configuration. `pipeline_bench.py` resets the
GPU's peak-memory counters before each configuration and again after its warm-up, so the
probe counts from the second reset to the third. `--all-steps` counts everything, which is
how to use it on CPUs, where nothing resets.

Wall time well above CPU time means the call waited: a lock, the compute token, the peer, the
GPU. On the GPU the graph replays are split by direction: `CUDAGraph.replay (forward)` and
`(backward)`. Session 27's figures on 2 x H200:
`bench/results/smp_host_probe_pp2_s27_h200x2_2026-11-28.txt`.
"""
import atexit
import collections
import functools
import os
import runpy
import sys
import threading
import time

import torch

import smdistributed.modelparallel.torch.runtime as rt
import smdistributed.modelparallel.torch.scheduler as scheduler
import smdistributed.modelparallel.torch.stage_graphs as sg
import smdistributed.modelparallel.torch.wire as wire
from timed_window import on_timed_steps

stats = collections.defaultdict(lambda: [0, 0.0, 0.0])  # name -> calls, wall s, thread CPU s
counting = [False]
phase = threading.local()  # which graphed direction the current thread replays


def timer(fn, name):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if not counting[0]:
            return fn(*args, **kwargs)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            s = stats[name() if callable(name) else name]
            s[0] += 1
            s[1] += time.perf_counter() - wall
            s[2] += time.thread_time() - cpu
    return timed


def wrap(owner, attr, label=None):
    raw = owner.__dict__[attr]
    static = isinstance(raw, staticmethod)
    fn = raw.__func__ if static else raw
    timed = timer(fn, label or f"{owner.__name__}.{attr}")
    setattr(owner, attr, staticmethod(timed) if static else timed)


def in_phase(direction, fn):
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        phase.direction = direction
        try:
            return fn(*args, **kwargs)
        finally:
            phase.direction = None
    return marked


def install():
    for attr in ["model_forward", "model_backward", "_backward_from_output", "_frame_backward", "_backward", "_serve",
                 "_serve_forward", "_wait_on", "_send_in_turn", "_without_token", "call_remote", "run_local_children",
                 "_enter_window", "_run_microbatch", "_check_grads_final", "_seeds", "_acquire_in_order",
                 "_graphable", "run_step", "_join_all"]:
        wrap(rt.PipelineRuntime, attr)
    # What a step costs outside the pipeline's schedule: its entry and exit, the optimizer.
    import smdistributed.modelparallel.torch.model as model_module
    import smdistributed.modelparallel.torch.step  # noqa: F401 (the package's `step` is the decorator)
    step_module = sys.modules["smdistributed.modelparallel.torch.step"]
    wrap(model_module.DistributedModel, "_run_step")
    step_module.split_arguments = timer(step_module.split_arguments, "step.split_arguments")
    step_module._outputs = timer(step_module._outputs, "step._outputs")
    torch.optim.SGD.step = timer(torch.optim.SGD.step, "torch.optim.SGD.step")
    for attr in ["run", "_key", "_lease", "_fingerprint", "release", "flush_gradients", "after_step", "release_all"]:
        wrap(sg.StageGraphs, attr)
    wrap(sg._StepAccumulator, "begin")
    for attr in ["send_encoded", "receive", "send", "made_at"]:
        wrap(wire.Links, attr)
    for attr in ["acquire", "release"]:
        wrap(scheduler.ComputeToken, attr)
    for direction in ("forward", "backward"):
        raw = sg._GraphedRun.__dict__[direction]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        timed = timer(in_phase(direction, fn), f"_GraphedRun.{direction}")
        setattr(sg._GraphedRun, direction, staticmethod(timed))
    torch.cuda.CUDAGraph.replay = timer(
        torch.cuda.CUDAGraph.replay, lambda: f"CUDAGraph.replay ({getattr(phase, 'direction', None) or 'other'})")
    torch.autograd.backward = timer(torch.autograd.backward, "torch.autograd.backward")
    try:  # the backend's NCCL path (absent without CUDA support)
        import smdistributed.dataparallel.torch.cuda_collectives as cc
        for attr in ["send", "recv", "flush_p2p"]:
            wrap(cc.CudaCollectives, attr)
        for attr in ["wait", "is_completed"]:
            wrap(cc.CudaWork, attr)
    except ImportError:
        pass

    def start():
        stats.clear()
        counting[0] = True

    def stop():
        counting[0] = False
    on_timed_steps(start, stop)
    wire.encode = timer(wire.encode, "wire.encode")
    rt.encode = wire.encode  # the runtime imported it by name
    wire.take = timer(wire.take, "wire.take")
    rt.take = wire.take


def report():
    rank = os.environ.get("RANK", "0")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
    print("\n".join(f"[probe rank {rank}] {name:42s} n={n:6d} wall_us={wall / n * 1e6:9.1f} "
                    f"cpu_us={cpu / n * 1e6:9.1f} total_ms={wall * 1e3:9.1f}"
                    for name, (n, wall, cpu) in rows if n), flush=True)


def main():
    argv = sys.argv[1:]
    if argv and argv[0] == "--all-steps":
        counting[0] = True
        argv = argv[1:]
    if not argv:
        sys.exit("usage: smp_host_probe.py [--all-steps] SCRIPT [ARGS...]")
    install()
    atexit.register(report)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
