"""Draws the allreduce benchmark's JSON as a PNG: bandwidth and latency against size.

    python bench/plot_allreduce.py bench/results/allreduce_cpu_2proc.json [out.png]
"""
from __future__ import annotations

import json
import sys

LABELS = {
    "smddp": "smdistributed-open (ours)",
    "gloo": "torch.distributed Gloo",
    "mpi": "Open MPI (mpi4py)",
}
STYLES = {
    "smddp": dict(color="tab:red", marker="o"),
    "gloo": dict(color="tab:blue", marker="s"),
    "mpi": dict(color="tab:green", marker="^"),
}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} GB"


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 5.2))
    sizes_seen = set()
    for impl in doc.get("impls", []):
        rows = sorted((r for r in doc["results"] if r["impl"] == impl), key=lambda r: r["bytes"])
        if not rows:
            continue
        x = [r["bytes"] for r in rows]
        sizes_seen.update(x)
        style = STYLES.get(impl, {})
        ax_bw.plot(x, [r["algbw_GBps"] for r in rows], label=LABELS.get(impl, impl), **style)
        ax_lat.plot(x, [r["median_us"] for r in rows], label=LABELS.get(impl, impl), **style)

    va = doc.get("vector_add")
    if va:
        ax_bw.axhline(va["algbw_GBps"], color="black", linestyle="--", linewidth=1,
                      label=f"vector add dst+=src, {human_bytes(va['bytes'])}, 1 process (reduce_into)")
        if va.get("numpy_add_algbw_GBps"):
            ax_bw.axhline(va["numpy_add_algbw_GBps"], color="gray", linestyle=":", linewidth=1,
                          label=f"numpy.add(out=dst), {human_bytes(va['bytes'])}, 1 process")

    ticks = sorted(sizes_seen)
    fmt = FuncFormatter(lambda v, _: human_bytes(v))
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if ticks:
            ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(fmt)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_xlabel("allreduce size (float32)")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("algorithm bandwidth, bytes / median time (GB/s)")
    ax_lat.set_ylabel("median latency (us)")
    ax_bw.legend(fontsize=8, loc="lower right")
    ax_lat.legend(fontsize=8, loc="upper left")

    m = doc.get("machine", {})
    fig.suptitle(f"CPU allreduce, {doc.get('np', 2)} processes on one host: {m.get('cpu_model', '?')}, "
                 f"{m.get('nproc', '?')} cores", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    out = argv[1] if len(argv) > 1 else argv[0].rsplit(".", 1)[0] + ".png"
    plot(doc, out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
