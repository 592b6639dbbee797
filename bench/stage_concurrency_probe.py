"""Would a stage run faster if a microbatch's forward overlapped the previous one's backward?
One GPU, no pipeline.

stage_graph_probe.py showed that even replayed as CUDA graphs, a stage of the pipeline
benchmark (8 encoder layers, width 1024, bf16) costs more per sample at microbatch sizes than
at the full batch: small matrices leave the GPU part idle. In a 1F1B steady state the stage's
next forward and its previous backward are independent (different microbatches), so they could
run on two streams at once. This probe measures what that gives, with graphs captured by hand
(one forward and one backward graph per instance; an instance per microbatch in flight):

- serial: F(i), B(i), F(i+1), B(i+1)... on one stream (what the pipeline does today);
- overlapped: F(i+1) on a forward stream while B(i) runs on a backward stream, each waiting
  only on what it reads (B(i) on F(i); F(i+k) on B(i), which frees instance i's activations).

    python bench/stage_concurrency_probe.py [--micro 16,8,4] [--n 32] [--instances 2,3]

It prints wall ms per microbatch (forward and backward) and the ratio serial / overlapped.
"""
from __future__ import annotations

import argparse
import time

import torch

from pipeline_model import encoder_layers

D, S = 1024, 256


class Instance:
    """A forward graph and a backward graph over static buffers: one microbatch in flight."""

    def __init__(self, stage, mb, dev):
        params = [p for p in stage.parameters()]
        self.x = torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        self.g = torch.randn(mb, S, D, device=dev, dtype=torch.bfloat16)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(3):
                torch.autograd.grad(stage(self.x), [self.x, *params], self.g)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd):
            out = stage(self.x)
        with torch.cuda.graph(self.bwd, pool=self.fwd.pool()):
            self.grads = torch.autograd.grad(out, [self.x, *params], self.g)
        self.out = out.detach()


def serial(insts, n):
    for i in range(n):
        inst = insts[i % len(insts)]
        inst.fwd.replay()
        inst.bwd.replay()


def overlapped(insts, n, fs, bs, dev):
    """F(i+1) on `fs` beside B(i) on `bs`. Events order only what shares data."""
    k = len(insts)
    f_done = [torch.cuda.Event() for _ in range(n)]
    b_done = [torch.cuda.Event() for _ in range(n)]
    fs.wait_stream(torch.cuda.current_stream(dev))
    bs.wait_stream(torch.cuda.current_stream(dev))

    def forward(i):
        with torch.cuda.stream(fs):
            if i >= k:
                fs.wait_event(b_done[i - k])  # instance reused: its last backward must be done
            insts[i % k].fwd.replay()
            f_done[i].record(fs)

    def backward(i):
        with torch.cuda.stream(bs):
            bs.wait_event(f_done[i])
            insts[i % k].bwd.replay()
            b_done[i].record(bs)

    forward(0)
    for i in range(n):
        if i + 1 < n:
            forward(i + 1)
        backward(i)
    torch.cuda.current_stream(dev).wait_stream(fs)
    torch.cuda.current_stream(dev).wait_stream(bs)


def wall_ms(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", default="16,8,4", help="samples per microbatch")
    ap.add_argument("--n", type=int, default=32, help="microbatches timed")
    ap.add_argument("--instances", default="2,3", help="graph instances (microbatches in flight)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    fs, bs = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    high = torch.cuda.Stream(dev, priority=-1)
    for mb in [int(m) for m in args.micro.split(",")]:
        stage = torch.nn.Sequential(*encoder_layers(8)).to(dev, torch.bfloat16)
        for k in [int(v) for v in args.instances.split(",")]:
            insts = [Instance(stage, mb, dev) for _ in range(k)]
            runs = {
                "serial": lambda i=insts: serial(i, args.n),
                "overlapped": lambda i=insts: overlapped(i, args.n, fs, bs, dev),
                "overlapped, backward at high priority": lambda i=insts: overlapped(i, args.n, fs, high, dev),
            }
            for fn in runs.values():
                fn()
            best = {name: min(wall_ms(fn, args.n) for _ in range(3)) for name, fn in runs.items()}
            base = best["serial"]
            text = ", ".join(f"{name} {ms:.2f} ms ({base / ms:.2f}x)" for name, ms in best.items())
            print(f"microbatch {mb:>2} samples, {k} instances: {text} per microbatch "
                  f"(serial {base / mb:.3f} ms a sample)", flush=True)
            del insts, runs
        del stage
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
