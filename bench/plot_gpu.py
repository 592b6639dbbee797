"""Draws the GPU benchmarks' JSON as PNGs.

    python bench/plot_gpu.py bench/results/gpu_allreduce_2gpu.json bench/results/gpu_ddp_scaling_2gpu.json

Writes the same names with .png: the allreduce bus bandwidth and latency against size, and
the DDP step times as bars with their scaling efficiency.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = {
    "smddp": ("smddp backend (ours)", dict(color="tab:red", marker="o")),
    "smddp_nochecks": ("smddp, SMDDP_CUDA_CHECKS=0", dict(color="tab:orange", marker="x", linestyle="--")),
    "nccl": ("torch NCCL backend", dict(color="tab:blue", marker="s")),
}


def size_label(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def plot_allreduce(doc: dict, out: Path) -> None:
    rows = doc["rows"]
    sizes = [r["bytes"] for r in rows]
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, (label, style) in SERIES.items():
        if key not in rows[0]:
            continue
        bw.plot(sizes, [r[key]["busbw_GBs"] for r in rows], label=label, **style)
        lat.plot(sizes, [r[key]["us"] for r in rows], label=label, **style)
    for ax in (bw, lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [size_label(s) for s in sizes], rotation=45)
        ax.grid(alpha=0.3)
        ax.set_xlabel("allreduce size (float32)")
    bw.set_ylabel("bus bandwidth (GB/s)")
    lat.set_ylabel("time per allreduce (us)")
    lat.set_yscale("log")
    bw.legend()
    fig.suptitle(f"allreduce on {doc['world']} x {doc['device']}, torch {doc['torch']}, NCCL {doc['nccl']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_ddp(doc: dict, out: Path) -> None:
    names = list(doc["results"])
    steps = [doc["results"][n]["step_ms"] for n in names]
    colors = ["tab:red" if n.startswith("smdistributed") else
              "tab:orange" if "smddp" in n else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(11, 5))
    bars = ax.barh(names, steps, color=colors)
    ax.axvline(doc["single_step_ms"], color="black", linestyle="--",
               label=f"one GPU, no DDP: {doc['single_step_ms']:.1f} ms")
    ax.axvline(doc["single_step_ms"] / 0.9, color="gray", linestyle=":", label="90% scaling efficiency")
    for bar, n in zip(bars, names):
        ax.text(bar.get_width() + 0.2, bar.get_y() + bar.get_height() / 2,
                f"{doc['results'][n]['step_ms']:.1f} ms, {doc['results'][n]['scaling_eff']:.0%}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms), slowest rank, best of the rounds")
    ax.set_xlim(0, max(steps) * 1.3)
    ax.legend(loc="upper right")
    ax.set_title(f"anchor transformer ({doc['params'] / 1e6:.0f}M params), {doc['world']} x {doc['device']}: "
                 "weak scaling")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(paths):
    for p in map(Path, paths):
        doc = json.loads(p.read_text())
        out = p.with_suffix(".png")
        (plot_allreduce if "rows" in doc else plot_ddp)(doc, out)
        print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1:])
