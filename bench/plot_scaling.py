"""Weak scaling over GPUs as curves: one line per configuration of bench/gpu_ddp_scaling.py,
scaling efficiency against the number of GPUs (1 GPU = 1.0), one panel per model.

    python bench/plot_scaling.py OUT.png results/gpu_ddp_scaling_2gpu_X.json results/gpu_ddp_scaling_4gpu_X.json

Each JSON is one run (its own one-GPU baseline, measured in the same run); the files of a
model are grouped by their "model" field.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def style(name: str) -> dict:
    # Colour: whose configuration; line: a diagnostic variant of it.
    line = ":" if "no checks" in name else "-." if "bucket view" in name else "--" if "checks wait" in name else None
    if "reducer alone" in name:  # the bound of any backend under torch's reducer
        return dict(color="black", marker="x", linestyle="-", linewidth=2)
    if name.startswith("smdistributed"):
        return dict(color="tab:red", marker="o")
    if "smddp" in name:
        return dict(color="tab:orange", marker="v" if "checks wait" in name else "D", linestyle=line or "-")
    return dict(color="tab:blue", marker="s", linestyle=line or "--")


def main(out: str, paths: list[str]) -> None:
    docs = [json.loads(Path(p).read_text()) for p in paths]
    models = sorted({d.get("model", "anchor") for d in docs})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = sorted((d for d in docs if d.get("model", "anchor") == model), key=lambda d: d["world"])
        names = list(dict.fromkeys(n for d in runs for n in d["results"]))
        for name in names:  # a configuration missing from a run is drawn through the others
            worlds = [1] + [d["world"] for d in runs if name in d["results"]]
            effs = [1.0] + [d["results"][name]["scaling_eff"] for d in runs if name in d["results"]]
            ax.plot(worlds, effs, label=name, **style(name))
            ax.annotate(f"{effs[-1]:.2f}", (worlds[-1], effs[-1]), textcoords="offset points", xytext=(6, 0),
                        fontsize=8, va="center")
        ax.axhline(0.95, color="gray", linestyle=":", label="target 0.95")
        ax.set_xticks([1] + [d["world"] for d in runs])
        ax.set_xlabel("GPUs")
        ax.set_ylabel("weak-scaling efficiency (one GPU's step time / step time)")
        ax.set_ylim(0.5, 1.05)
        ax.grid(alpha=0.3)
        ax.set_title(f"{model} ({runs[0]['params'] / 1e6:.0f}M params)")
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"weak scaling on {docs[0]['device']}, torch {docs[0]['torch']}\n(each point: its run's own "
                 "one-GPU step time over its step time)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
