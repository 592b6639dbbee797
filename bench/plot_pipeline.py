"""bench/pipeline_bench.py's RESULT JSON as a PNG: throughput against one device (and the
ideal of each configuration) on the left, the largest peak memory of any rank on the right.

    python bench/plot_pipeline.py OUT.png bench/results/pipeline_4gpu_X.json [more runs of other layouts]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def color(name: str) -> str:
    return "tab:red" if name.startswith("smp") else "tab:green" if "ddp" in name else "tab:blue"


def main(out: str, paths: list[str]) -> None:
    labels, colors, entries = [], [], []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        layout = f"pp={doc['pp']}" + (f" x dp={doc['dp']}" if doc.get("dp", 1) > 1 else "")
        for name, entry in doc.items():
            if isinstance(entry, dict) and "speedup_vs_single" in entry:
                where = f"dp={doc['world']}" if "ddp" in name else layout
                labels.append(f"{where}: {name}")
                colors.append(color(name))
                entries.append(entry)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.32 * len(entries) + 1.8), sharey=True)
    left.barh(labels, [e["speedup_vs_single"] for e in entries], color=colors)
    left.scatter([e["ideal"] for e in entries], labels, marker="|", s=200, color="black", label="ideal")
    left.set_xlabel("samples/s over one GPU's (the whole model, one GPU)")
    left.legend(loc="lower right")
    if all("peak_reserved_gb" in e for e in entries):
        # Reserved includes what CUDA graph pools hold between replays, which allocated omits.
        right.barh(labels, [max(e["peak_reserved_gb"]) for e in entries], color=colors, alpha=0.2,
                   label="reserved (warm-up and captures included)")
    if all("steady_reserved_gb" in e for e in entries):
        right.barh(labels, [max(e["steady_reserved_gb"]) for e in entries], color=colors, alpha=0.45,
                   label="reserved (timed steps)")
    right.barh(labels, [max(e["peak_gb"]) for e in entries], color=colors, label="allocated")
    if all("peak_reserved_gb" in e for e in entries):
        right.legend(loc="center right")
    right.set_xlabel("peak GPU memory of the busiest rank (GB)")
    left.invert_yaxis()
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    doc = json.loads(Path(paths[0]).read_text())
    fig.suptitle(f"{doc['model']}, {doc['world']} x {doc['device']}, torch {doc['torch']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
