"""Would CUDA graphs take the host out of a pipeline stage's way? One GPU, no pipeline.

A stage of the pipeline benchmark (8 of its 16 encoder layers, width 1024, bf16) runs the
forward and backward of N microbatches back to back, eagerly and as a graphed callable
(`torch.cuda.make_graphed_callables`: one replay each for forward and backward). For each
microbatch size it prints the host's time to issue the N microbatches and the wall time until
the GPU is done, per microbatch, and the whole model's step on one GPU at the full batch for
reference.

    python bench/stage_graph_probe.py [--micro 16,8,4] [--n 32]

A stage is host-bound where host ms is close to wall ms: the GPU waits for kernel launches.
"""
from __future__ import annotations

import argparse
import time

import torch

from pipeline_model import encoder_layers

D, S, B = 1024, 256, 64


def timed(stage, xs, grads):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, g in zip(xs, grads):
        stage(x).backward(g)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (issued - t0) * 1e3 / len(xs), (end - t0) * 1e3 / len(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", default="16,8,4", help="samples per microbatch")
    ap.add_argument("--n", type=int, default=32, help="microbatches timed")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    whole = torch.nn.Sequential(*encoder_layers(16)).to(dev, torch.bfloat16)
    x = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        whole(x).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        whole(x).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 100
    print(f"one GPU, 16 layers, batch {B}: {step_ms:.2f} ms/step (so 8 layers take "
          f"{step_ms / B / 2:.3f} ms a sample, forward and backward)")
    del whole
    for mb in [int(m) for m in args.micro.split(",")]:
        stage = torch.nn.Sequential(*encoder_layers(8)).to(dev, torch.bfloat16)
        xs = [torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(args.n)]
        gs = [torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16) for _ in range(args.n)]
        for _ in range(2):
            timed(stage, xs[:4], gs[:4])
        eager = min(timed(stage, xs, gs) for _ in range(3))
        sample = torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(stage, (sample,))
        for _ in range(2):
            timed(graphed, xs[:4], gs[:4])
        replay = min(timed(graphed, xs, gs) for _ in range(3))
        print(f"microbatch {mb:>2} samples: eager host {eager[0]:6.2f} / wall {eager[1]:6.2f} ms, "
              f"graphed host {replay[0]:6.2f} / wall {replay[1]:6.2f} ms per microbatch "
              f"(GPU-bound floor {eager[1] / mb:.3f} -> {replay[1] / mb:.3f} ms a sample)")
        del stage, graphed


if __name__ == "__main__":
    main()
