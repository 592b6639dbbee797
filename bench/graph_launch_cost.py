"""What a stage graph's replay costs the host, and when: one GPU, the pipeline benchmark's stage
(8 encoder layers of width 1024, bf16), graphed as the pipeline graphs it (stage_graphs'
_Instance: a forward graph and a backward graph that adds the parameters' gradients).

    python3 bench/graph_launch_cost.py [--samples 8] [--reps 40]

Why: on 2 x H200 at m = 8 (session 27) the last stage's backward replay held its thread, and
the compute token, 0.93 ms a microbatch, the first stage's 0.15 ms; a torch profiler trace
showed other threads' CUDA calls (event records) waiting for a replay to end. Each case below
times the host side of `replay()` (perf_counter around the call), median and 90th percentile
over --reps replays:

- idle: the GPU idle before each replay (synchronized);
- behind its own: the same backward graph replayed again while its previous launch runs;
- behind another: a second instance's backward while the first instance's runs;
- burst: 12 replays of one backward graph back to back;
- queue: one replay behind 20 ms of queued matmuls (a deep stream);
- F, B in turn: one instance's forward and backward replayed in turn, nothing else, then with
  a loss's eager kernels between them;
- last stage: the last stage's pattern with the host ahead of the GPU (forward replay, a
  loss's eager kernels, backward replay, no synchronization), one instance and then two in turn;
- contended: replays while another thread records CUDA events and makes streams wait on them
  in a loop (what the receiver and send threads do).

Found on one H200 (session 27, `bench/results/session27_2026-11-28.md`): a replay returns
in 20-130 us in every case but "F, B in turn" and "last stage", where the forward's replay
takes 0.43-0.9 ms and the backward's 3.2-3.8 ms. The two add up to the GPU time of the pair,
so the host moves in lockstep with the GPU. A launch holds the host when the same graph's
previous launch has not finished and other work was queued after it; a burst of launches of
one graph does not.
"""
import argparse
import statistics
import sys
import threading
import time

import torch

from pipeline_model import encoder_layers
from smdistributed.modelparallel.torch import stage_graphs as sg

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=8, help="samples a microbatch (64 / m)")
p.add_argument("--reps", type=int, default=40)
args = p.parse_args()
S, D = 256, 1024


def make_instances(stage, n, dev, input_grad=True):
    """`n` instances of one run, built as the pipeline builds them (after two eager runs)."""
    x = torch.randn(args.samples, S, D, device=dev, dtype=torch.bfloat16, requires_grad=input_grad)
    for _ in range(sg.WARMUP_CALLS):
        torch.autograd.grad(stage(x).float().square().mean(), [x, *stage.parameters()] if input_grad
                            else list(stage.parameters()))
    pool = torch.cuda.graph_pool_handle()
    params = [q for q in stage.parameters() if q.requires_grad]
    buffers = [torch.zeros_like(q) for q in params]
    acc = sg._StepAccumulator()
    stream = torch.cuda.Stream(dev)
    insts = [sg._Instance(list(stage), x, stream, None, pool, buffers, acc) for _ in range(n)]
    torch.cuda.synchronize(dev)
    return insts, x


def timed_replay(graph) -> float:
    t = time.perf_counter()
    graph.replay()
    return (time.perf_counter() - t) * 1e6


def summary(name, us):
    us = sorted(us)
    print(f"{name:38s} median {statistics.median(us):8.1f} us   p90 {us[int(0.9 * (len(us) - 1))]:8.1f} us", flush=True)


def after(first, graph, reps):
    """Host us of `graph`'s replay, each made on an idle GPU right after `first()`."""
    us = []
    for _ in range(reps):
        torch.cuda.synchronize()
        first()
        us.append(timed_replay(graph))
    return us


def in_turn(label, insts, x, loss, copy_input):
    """Forward and backward replays in turn over `insts` with the host ahead of the GPU (no
    synchronization), with the loss's eager kernels between them (`loss`) and the input
    copied into the static buffer first (`copy_input`, as the pipeline does)."""
    target = torch.randn_like(insts[0].static_out, dtype=torch.float32)
    parts = {"forward": [], "eager": [], "backward": []}
    torch.cuda.synchronize()
    for i in range(args.reps):
        inst = insts[i % len(insts)]
        if copy_input:
            inst.static_in.copy_(x)
        parts["forward"].append(timed_replay(inst.fwd))
        t = time.perf_counter()
        if loss:
            inst.static_grad_out.copy_(2 * (inst.static_out.float() - target) / target.numel())
        parts["eager"].append((time.perf_counter() - t) * 1e6)
        parts["backward"].append(timed_replay(inst.bwd))
    torch.cuda.synchronize()
    for part, us in parts.items():
        summary(f"{label}: {part}", us)


def main():
    if not torch.cuda.is_available():
        sys.exit("graph_launch_cost.py needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stage = torch.nn.Sequential(*encoder_layers(8)).to(dev, torch.bfloat16)
    (a, b), x = make_instances(stage, 2, dev)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}: a stage of 8 encoder layers, "
          f"{args.samples} samples a microbatch", flush=True)

    def nothing():
        pass

    summary("idle: forward", after(nothing, a.fwd, args.reps))
    summary("idle: backward", after(nothing, a.bwd, args.reps))
    summary("behind its own: backward", after(a.bwd.replay, a.bwd, args.reps))
    summary("behind another: backward", after(a.bwd.replay, b.bwd, args.reps))

    torch.cuda.synchronize()
    burst = [timed_replay(a.bwd) for _ in range(12)]
    print("burst of 12 backward replays, host us each: " + " ".join(f"{u:.0f}" for u in burst), flush=True)

    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def matmuls():
        for _ in range(20):
            big @ big  # about 1 ms each on an H100/H200

    summary("queue (20 matmuls ahead): backward", after(matmuls, b.bwd, args.reps // 4))

    in_turn("F, B in turn, replays only", [a], x, loss=False, copy_input=False)
    in_turn("F, B in turn, with the loss's kernels", [a], x, loss=True, copy_input=False)
    in_turn("last stage, one instance", [a], x, loss=True, copy_input=True)
    in_turn("last stage, two in turn", [a, b], x, loss=True, copy_input=True)

    stop = threading.Event()
    side = torch.cuda.Stream(dev)

    def events():
        while not stop.is_set():
            e = torch.cuda.Event()
            e.record(side)
            torch.cuda.current_stream(dev).wait_event(e)
            time.sleep(0.00005)

    t = threading.Thread(target=events, daemon=True)
    t.start()
    us = after(nothing, a.bwd, args.reps)
    stop.set()
    t.join()
    summary("contended (event records): backward", us)


if __name__ == "__main__":
    main()
