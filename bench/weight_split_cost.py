"""What splitting a graphed stage's backward costs and what it can save (SMDDP_SMP_DEFER_WEIGHT_GRADS).
One GPU, no pipeline.

The pipeline benchmark's last stage (8 encoder layers, width 1024, bf16, sequence 256; its
input needs a gradient) is captured through smp's StageGraphs twice, with one backward graph
and with the split one (weight_split.py), for a batch of 64 split into M microbatches. Each
graph is replayed alone, back to back, and timed with CUDA events: the forward (f), the one
backward (B), the input pass (b) and the weight pass (w). It prints those, the shared
backward pool's reserved GB both ways, and what they mean for a 2-stage pipeline of two such
stages, against the whole model on one GPU (16 layers, batch 64, eager forward and backward,
timed in the same run):
- 1F1B: (m + 1) (f + B);
- the weight pass deferred on the last stage: f + m (f + b + w) + b (the first stage's last
  backward starts after the last stage's input pass; see weight_split.py).
These are bounds from one stage's GPU time (the host, the transfers and the two GPUs'
differences are not in them): what to expect of the pipeline, to check against
bench/pipeline_bench.py on two GPUs.

    python bench/weight_split_cost.py [--micro 4,8,16] [--reps 20]
"""
from __future__ import annotations

import argparse
import collections
import gc

import torch

from pipeline_model import encoder_layers
from smdistributed.modelparallel.torch.stage_graphs import StageGraphs

GB = 2**30
D, S, BATCH = 1024, 256, 64


def timed(fn, reps):
    """Mean ms of `fn` over `reps` calls queued back to back (after one untimed call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def backward_pool_gb(graphs):
    labels = graphs.pool_labels()
    sizes = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        sizes[labels.get(tuple(segment.get("segment_pool_id", (0, 0))), "other")] += segment["total_size"]
    return sizes["backward"] / GB


def stage_times(m, split, reps, dev):
    stage = torch.nn.Sequential(*encoder_layers(8)).to(dev, torch.bfloat16)
    graphs = StageGraphs(True, split_weights=split)
    graphs.limit = 1
    x = torch.randn(BATCH // m, S, D, device=dev, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    for _ in range(3):  # two eager calls, then the capture
        leases = []
        inp = x.clone().requires_grad_()
        out = graphs.run(("stage",), list(stage), inp, leases, lambda: stage(inp))
        out.backward(g)
        graphs.release(leases)
        graphs.flush_gradients()
    (inst,) = [i for e in graphs._entries.values() for i in e.instances]
    assert (inst.bwd_w is not None) == split, inst.not_split
    times = {"f": timed(inst.fwd.replay, reps)}
    if split:
        times["b"] = timed(inst.bwd.replay, reps)
        times["w"] = timed(inst.bwd_w.replay, reps)
        times["b+w"] = timed(lambda: (inst.bwd.replay(), inst.bwd_w.replay()), reps)
    else:
        times["B"] = timed(inst.bwd.replay, reps)
    times["pool_gb"] = backward_pool_gb(graphs)
    graphs.clear()
    return times


def one_gpu_ms(reps, dev):
    model = torch.nn.Sequential(*encoder_layers(16)).to(dev, torch.bfloat16)
    x = torch.randn(BATCH, S, D, device=dev, dtype=torch.bfloat16)

    def step():
        model(x).float().pow(2).mean().backward()
    return timed(step, max(3, reps // 4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", default="4,8,16", help="microbatches of the batch of 64")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    one = one_gpu_ms(args.reps, dev)
    print(f"one GPU, 16 layers, batch {BATCH}: {one:.2f} ms forward and backward (eager)")
    for m in [int(v) for v in args.micro.split(",")]:
        gc.collect()
        torch.cuda.empty_cache()
        whole = stage_times(m, False, args.reps, dev)
        gc.collect()
        torch.cuda.empty_cache()
        split = stage_times(m, True, args.reps, dev)
        f, B = whole["f"], whole["B"]
        b, w = split["b"], split["w"]
        one_f1b = (m + 1) * (f + B)
        deferred = split["f"] + m * (split["f"] + split["b+w"]) + b
        print(f"m = {m} ({BATCH // m} samples): f {f:.2f} ms, B {B:.2f} | split: f {split['f']:.2f}, "
              f"b {b:.2f}, w {w:.2f}, b then w {split['b+w']:.2f} ms; backward pool {whole['pool_gb']:.3f} -> "
              f"{split['pool_gb']:.3f} GB")
        print(f"    2-stage bound: 1F1B {one_f1b:.1f} ms ({one / one_f1b:.2f}x one GPU), weight pass deferred "
              f"{deferred:.1f} ms ({one / deferred:.2f}x one GPU)")


if __name__ == "__main__":
    main()
