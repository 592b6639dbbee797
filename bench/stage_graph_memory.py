"""Where a graphed stage's memory goes, against the same stage run eagerly. One GPU, no pipeline.

The pipeline benchmark's first stage (8 encoder layers, width 1024, bf16, sequence 256) runs
the forwards and backwards of a 1F1B stage 0 at pp=2 (F0 F1 B0 F2 B1 ... : two microbatches
in flight) for a batch of 64 split into M microbatches, through smp's StageGraphs (the code
the pipeline runs under SMDDP_SMP_CUDA_GRAPHS=1) and eagerly. After warm-up steps (the
captures happen there) it prints, for steady steps, the most allocated and the reserved GB,
the graphed variant's reserved GB by pool (each instance's forward pool, the shared backward
pool, the rest), the time a step
takes (5 steps by default, a short sample), and the sizes they are made of: the stage's
parameters (its gradients and the graphs' gradient buffers are as large) and
one microbatch's saved activations.

    python bench/stage_graph_memory.py [--micro 4,8,16] [--steps 5]
"""
from __future__ import annotations

import argparse
import collections
import gc
import time

import torch

from pipeline_model import encoder_layers
from smdistributed.modelparallel.torch.stage_graphs import StageGraphs

GB = 2**30
D, S, BATCH = 1024, 256, 64


def schedule(m):
    """1F1B stage 0 at pp=2: ("F", i) and ("B", i) in order, two microbatches in flight."""
    order, f = [("F", 0), ("F", 1)], 2
    for b in range(m):
        order.append(("B", b))
        if f < m:
            order.append(("F", f))
            f += 1
    return [op for op in order if op[1] < m]


def by_pool(graphs):
    labels = graphs.pool_labels() if graphs is not None else {}
    split = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        split[labels.get(tuple(segment.get("segment_pool_id", (0, 0))), "other")] += segment["total_size"]
    return {k: round(v / GB, 3) for k, v in sorted(split.items())}


def run(m, graphed, steps, dev):
    stage = torch.nn.Sequential(*encoder_layers(8)).to(dev, torch.bfloat16)
    children = list(stage)
    graphs = StageGraphs(True) if graphed else None
    if graphs is not None:
        graphs.limit = 2
    mb = BATCH // m
    xs = [torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16) for _ in range(m)]
    gs = [torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16) for _ in range(m)]

    def step():
        for p in stage.parameters():
            p.grad = None
        outs, leases = {}, {}
        for op, i in schedule(m):
            if op == "F":
                leases[i] = []

                def eager(x=xs[i]):
                    return stage(x)
                outs[i] = graphs.run(("stage",), children, xs[i], leases[i], eager) if graphs else eager()
            else:
                outs.pop(i).backward(gs[i])
                if graphs is not None:
                    graphs.release(leases.pop(i))
        if graphs is not None:
            graphs.flush_gradients()
            graphs.after_step()

    for _ in range(4):  # warm-up: eager calls, then the captures
        step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    out = dict(ms=(time.perf_counter() - started) * 1e3 / steps,
               peak_allocated=torch.cuda.max_memory_allocated() / GB, reserved=torch.cuda.memory_reserved() / GB,
               peak_reserved=torch.cuda.max_memory_reserved() / GB, pools=by_pool(graphs))
    if graphs is not None:
        out["instances"] = graphs.layout()["instances"]
        out["replays"] = graphs.counters["replays"]
    return out


def activation_gb(m, dev):
    """One microbatch's saved activations: allocated after an eager forward, less before."""
    stage = torch.nn.Sequential(*encoder_layers(8)).to(dev, torch.bfloat16)
    x = torch.randn(BATCH // m, S, D, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = stage(x)
    torch.cuda.synchronize()
    size = (torch.cuda.memory_allocated() - before) / GB
    params = sum(p.numel() * p.element_size() for p in stage.parameters()) / GB
    del out, stage
    return size, params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", default="4,8,16", help="microbatches of the batch of 64")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    for m in [int(v) for v in args.micro.split(",")]:
        act, params = activation_gb(m, dev)
        print(f"m = {m} ({BATCH // m} samples a microbatch): parameters {params:.3f} GB, "
              f"one microbatch's saved activations {act:.3f} GB")
        for graphed in (False, True):
            gc.collect()
            torch.cuda.empty_cache()
            r = run(m, graphed, args.steps, dev)
            name = "graphed" if graphed else "eager"
            extra = f", instances {r['instances']}, replays {r['replays']}" if graphed else ""
            print(f"  {name:8s} {r['ms']:.1f} ms a step, peak allocated {r['peak_allocated']:.3f} GB, "
                  f"reserved {r['reserved']:.3f} GB (peak {r['peak_reserved']:.3f}), by pool {r['pools']}{extra}")
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
