"""DDP training step time on CPU: torch DDP over Gloo vs over smddp vs the older wrapper.

Run it under a launcher (2 processes):

    smddprun -np 2 python bench/ddp_step_time.py [--model mlp|cnn] [--steps 30] [--rounds 3]

The same processes hold a world group on smddp and a Gloo group beside it, so all three
configurations train the same model on the same data in the same run. Each round times
every configuration in turn (warmup steps first); a configuration's result is the median
step of its best round, the slowest rank's time per step. Rank 0 prints the table and
writes bench/results/ddp_cpu_2proc_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as LegacyDDP

RESULTS = Path(__file__).resolve().parent / "results"


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":  # 12.6M parameters, 50 MB of float32 gradients per step
        layers = []
        for _ in range(6):
            layers += [nn.Linear(1448, 1448), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(1448, 10))
    # The digits CNN of examples/pytorch (0.05M parameters): communication latency bound.
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def batch(kind: str, size: int):
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    if kind == "mlp":
        return torch.randn(size, 1448, generator=g), torch.randint(0, 10, (size,), generator=g)
    return torch.randn(size, 1, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g)


def time_steps(model, x, y, steps: int, warmup: int) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    # The step time of the job is the slowest rank's.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--batch", type=int, default=32, help="per-process batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)  # one core per process, as a data-parallel job would pin them
    dist.init_process_group(backend="smddp")
    gloo = dist.new_group(backend="gloo")
    x, y = batch(args.model, args.batch)
    configs = {
        # The floor: the same step with no gradient exchange at all.
        "no communication": lambda m: m,
        "torch DDP, gloo": lambda m: nn.parallel.DistributedDataParallel(m, process_group=gloo),
        "torch DDP, smddp": lambda m: nn.parallel.DistributedDataParallel(m),
        "smdistributed DDP": lambda m: LegacyDDP(m),
    }
    best = {name: None for name in configs}
    for _ in range(args.rounds):
        for name, wrap in configs.items():
            model = wrap(build_model(args.model))
            median = statistics.median(time_steps(model, x, y, args.steps, args.warmup))
            best[name] = median if best[name] is None else min(best[name], median)
            del model
    if dist.get_rank() == 0:
        n_params = sum(p.numel() for p in build_model(args.model).parameters())
        gloo_t = best["torch DDP, gloo"]
        print(f"model {args.model}: {n_params / 1e6:.2f}M parameters, batch {args.batch} per process, "
              f"{dist.get_world_size()} processes")
        floor = best["no communication"]
        print(f"{'configuration':<20} {'step ms':>9} {'vs gloo':>9} {'comm overhead ms':>17}")
        rows = []
        for name, t in best.items():
            print(f"{name:<20} {t * 1e3:9.2f} {gloo_t / t:8.2f}x {(t - floor) * 1e3:17.2f}")
            rows.append({"configuration": name, "median_step_ms": t * 1e3, "speedup_vs_gloo": gloo_t / t,
                         "overhead_vs_no_communication_ms": (t - floor) * 1e3})
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"ddp_cpu_{dist.get_world_size()}proc_{args.model}.json"
        out.write_text(json.dumps({
            "benchmark": "DDP training step time on CPU",
            "command": f"smddprun -np {dist.get_world_size()} python bench/ddp_step_time.py --model {args.model} "
                       f"--batch {args.batch} --steps {args.steps} --rounds {args.rounds}",
            "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"nproc": os.cpu_count(), "processor": platform.processor() or platform.machine()},
            "torch": torch.__version__, "parameters": n_params, "rows": rows,
        }, indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
