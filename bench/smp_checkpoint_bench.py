"""Saving and loading a 1B-parameter model with smp against torch.save from one process.

    smddprun -np 2 python bench/smp_checkpoint_bench.py [--dir /tmp/ckpt] [--width 8192 --layers 15]

The model is --layers Linear(width, width) layers (15 x 8192^2 = 1.0B float32 parameters,
4 GB), partitioned over the processes (one partition each). Timed in the same run, each
operation --rounds times (best kept); a save ends when every file is fsynced, a load starts
with the page cache dropped (when we may):
  torch.save / torch.load     the whole model's state dict, from one process (rank 0)
  smp partial save / load     smp.save(model.local_state_dict(), partial=True) on every rank
                              at once (one file each), then smp.load + load_state_dict
  smp full save / load        smp.save(model.state_dict(), partial=False): gathered to rank 0,
                              one file; then every rank loads it and keeps its partition
Rank 0 prints a table and writes bench/results/smp_checkpoint_<n>proc.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn as nn

import smdistributed.modelparallel.torch as smp

RESULTS = Path(__file__).resolve().parent / "results"


def fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache() -> bool:
    """Loads then read from the disk, not from memory (needs root; else they may be cached)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/smp_ckpt_bench")
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="every operation is timed this many times; best kept")
    args = ap.parse_args()
    n = int(os.environ.get("WORLD_SIZE", os.environ.get("SMDDP_SIZE", "1")))
    smp.init({"partitions": n, "microbatches": 1, "auto_partition": True})
    dev = torch.device("cpu")
    if torch.cuda.is_available():  # one GPU per rank, as the seed scripts set it
        torch.cuda.set_device(smp.local_rank())
        dev = torch.device("cuda", smp.local_rank())
    torch.manual_seed(0)
    with torch.no_grad():
        module = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    params = sum(p.numel() for p in module.parameters())
    model = smp.DistributedModel(module, trace_device="cpu")

    @smp.step
    def forward(model, x):
        return model(x)

    with torch.no_grad():
        forward(model, torch.zeros(1, args.width, device=dev))  # partitions the model
    if smp.rank() == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    smp.barrier()
    rows = {}
    dropped = []

    def timed(name, fn, everyone=True):
        if "load" in name:
            smp.barrier()
            if smp.local_rank() == 0:
                dropped.append(drop_page_cache())
        smp.barrier()
        t0 = time.perf_counter()
        if everyone or smp.rank() == 0:
            fn()
        smp.barrier()
        if "save" in name:
            fsync_tree(args.dir)  # on the disk, not just in the page cache
            smp.barrier()  # the slowest rank's time
        rows[name] = min(rows.get(name, float("inf")), time.perf_counter() - t0)

    def clean():
        smp.barrier()
        if smp.rank() == 0:
            for f in os.listdir(args.dir):
                os.unlink(os.path.join(args.dir, f))
        smp.barrier()

    whole = os.path.join(args.dir, "whole.pt")
    part = os.path.join(args.dir, "model.pt")
    full = os.path.join(args.dir, "full.pt")
    for _ in range(args.rounds):
        timed("torch.save, one process", lambda: torch.save(module.state_dict(), whole), everyone=False)
        timed("torch.load, one process", lambda: module.load_state_dict(torch.load(whole)), everyone=False)
        clean()
        timed("smp partial save", lambda: smp.save(model.local_state_dict(), part, partial=True))
        timed("smp partial load", lambda: model.load_state_dict(smp.load(part, partial=True)))
        clean()
        timed("smp full save", lambda: smp.save(model.state_dict(), full, partial=False))
        timed("smp full load", lambda: model.load_state_dict(smp.load(full, partial=False)))
        clean()
    if smp.rank() == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        gb = params * 4 / 1e9
        print(f"{params / 1e9:.2f}B float32 parameters ({gb:.1f} GB), {n} partitions, torch {torch.__version__}; "
              f"page cache dropped before loads: {all(dropped)}")
        print(f"{'operation':<28} {'seconds':>8} {'GB/s':>6}")
        for name, t in rows.items():
            print(f"{name:<28} {t:>8.2f} {gb / t:>6.2f}")
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"smp_checkpoint_{n}proc.json"
        out.write_text(json.dumps(dict(
            command=f"smddprun -np {n} python bench/smp_checkpoint_bench.py --width {args.width} --layers {args.layers}"
                    f" --rounds {args.rounds}",
            machine=f"{os.cpu_count()} CPUs", torch=torch.__version__, parameters=params, partitions=n,
            loads_from_disk=all(dropped), seconds=rows), indent=1))
        print("wrote", out)


if __name__ == "__main__":
    main()
    # Torch's Gloo groups left to interpreter exit can abort it (a Gloo thread frees a work
    # holding Python tensors during finalization): end them first.
    torch.distributed.destroy_process_group()
