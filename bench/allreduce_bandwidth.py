"""CPU allreduce benchmark: this project's core against torch.distributed Gloo and Open MPI.

    python bench/allreduce_bandwidth.py                 # full run, ~1-3 minutes
    python bench/allreduce_bandwidth.py --quick         # a few small sizes (CI smoke)
    python bench/allreduce_bandwidth.py --sizes 4K,64M --impls smddp,gloo

Two jobs of --np ranks (default 2) on this host, one after the other:
  1. smddprun -np 2 -- python bench/allreduce_worker.py --impl smddp,gloo ...
     the same processes time our core and Gloo back to back on the same buffers
     (Gloo works on torch.from_numpy views of the numpy arrays the core reduces);
  2. mpirun -np 2 python bench/allreduce_worker.py --impl mpi ...
     mpi4py's Allreduce on numpy buffers of the same sizes.
Then, in this process, the single-process in-place vector add (the core's reduce_into
kernel) of 64 MB, the memory-bound reference. The merged results are printed as a
table, written as JSON and drawn as a PNG (bench/results/allreduce_cpu_<np>proc.*).

An implementation whose library is missing (torch, mpi4py or mpirun) is skipped with
a note, so the smoke run works wherever the package itself is installed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "allreduce_worker.py"
sys.path.insert(0, str(HERE))

from plot_allreduce import human_bytes, plot  # noqa: E402
from vector_add import measure_vector_add  # noqa: E402

ALL_IMPLS = ("smddp", "gloo", "mpi")
FULL_SIZES = [4 << 10 << (2 * i) for i in range(9)]  # 4 KB, 16 KB, ..., 64 MB, 256 MB
QUICK_SIZES = [4 << 10, 256 << 10, 4 << 20]
JOB_TIMEOUT_S = 600
VECTOR_ADD_BYTES = 64 << 20
# The mpirun fallback for containers where cross-memory attach (CMA) is not allowed.
NO_CMA = ["--mca", "btl_vader_single_copy_mechanism", "none"]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4096, 4K, 64M, 1G)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help="comma-separated sizes in bytes, K/M/G suffixes allowed "
                                   "(default 4K,16K,...,64M,256M: powers of 4)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: sizes {','.join(human_bytes(s) for s in QUICK_SIZES)}, 0.1 s each, "
                        "results in a temporary folder unless --out is given")
    p.add_argument("--impls", default=",".join(ALL_IMPLS), help="comma-separated subset of smddp,gloo,mpi")
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--seconds", type=float,
                   help="timed work per implementation and size, split over the rounds (default 0.6, quick 0.1)")
    p.add_argument("--rounds", type=int,
                   help="interleaved rounds per size, the least disturbed one is kept (default 3, quick 1)")
    p.add_argument("--out", help="output path prefix, .json and .png are added "
                                 "(default bench/results/allreduce_cpu_<np>proc)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.sizes:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    else:
        args.size_list = QUICK_SIZES if args.quick else FULL_SIZES
    bad = [s for s in args.size_list if s <= 0 or s % 32]
    if bad:
        p.error(f"sizes must be positive multiples of 32 bytes: {bad}")
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = [s for s in args.impl_list if s not in ALL_IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {unknown}; choose from {','.join(ALL_IMPLS)}")
    if args.seconds is None:
        args.seconds = 0.1 if args.quick else 0.6
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.out is None:
        base = Path(tempfile.gettempdir()) / "smddp_bench" if args.quick else HERE / "results"
        suffix = "_quick" if args.quick else ""
        args.out = str(base / f"allreduce_cpu_{args.np}proc{suffix}")
    return args


# ----------------------------------------------------------------------------- environment

def _run_text(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _module_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def machine_info() -> dict:
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
                    break
    except OSError:
        pass
    mpirun = shutil.which("mpirun")
    ompi = _run_text([mpirun, "--version"]).splitlines()[0] if mpirun else None
    commit = _run_text(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or None
    dirty = bool(_run_text(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]))
    return {
        "nproc": _run_text(["nproc"]) or str(len(os.sched_getaffinity(0))),
        "cpu_model": cpu_model,
        "mem_total_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            "smdistributed-open": _module_version("smdistributed-open"),
            "numpy": _module_version("numpy"),
            "torch": _module_version("torch"),
            "mpi4py": _module_version("mpi4py"),
            "openmpi": ompi,
        },
        "git_commit": (commit + ("-dirty" if dirty else "")) if commit else None,
    }


# ----------------------------------------------------------------------------- jobs

def _smddprun() -> list[str]:
    exe = shutil.which("smddprun")
    return [exe] if exe else [sys.executable, "-m", "smdistributed.common.launcher"]


def _worker_args(impls: list[str], args, out: Path) -> list[str]:
    return [sys.executable, str(WORKER), "--impl", ",".join(impls),
            "--sizes", ",".join(str(s) for s in args.size_list),
            "--seconds", str(args.seconds), "--rounds", str(args.rounds), "--out", str(out)]


def _run_job(cmd: list[str], env=None) -> tuple[int, str]:
    """Runs one launcher, echoing its output live; returns (status, output)."""
    print("$ " + shlex.join(cmd), flush=True)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, stdin=subprocess.DEVNULL, cwd=str(REPO))
    except OSError as e:
        return 127, str(e)
    lines: list[str] = []

    def pump():
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print("  " + line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Stop the launcher; it takes its ranks down (smddprun's death signal, mpirun's daemons).
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rc = 124
        lines.append(f"\n(timed out after {JOB_TIMEOUT_S} s)\n")
    reader.join(timeout=10)
    return rc, "".join(lines)


def run_smddprun_job(impls: list[str], args, tmp: Path) -> tuple[dict | None, str, str]:
    out = tmp / "smddprun.json"
    cmd = _smddprun() + ["-np", str(args.np), "--"] + _worker_args(impls, args, out)
    rc, text = _run_job(cmd)
    if rc != 0 or not out.exists():
        return None, shlex.join(cmd), f"smddprun job failed (status {rc}):\n{text[-3000:]}"
    return json.loads(out.read_text()), shlex.join(cmd), ""


def run_mpirun_job(args, tmp: Path) -> tuple[dict | None, str, str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "", "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    if _module_version("mpi4py") is None:
        return None, "", "mpi4py not installed (pip install mpi4py)"
    out = tmp / "mpirun.json"
    base = [mpirun, "-np", str(args.np), "--oversubscribe",
            # No binding, like smddprun's ranks; shared memory between the ranks only and
            # mpirun's own control traffic on loopback.
            "--bind-to", "none", "--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo"]
    if os.geteuid() == 0:
        base.insert(1, "--allow-run-as-root")
    env = dict(os.environ)
    for key in list(env):  # our launcher's variables would only confuse the MPI ranks
        if key.startswith("SMDDP_"):
            del env[key]
    worker = _worker_args(["mpi"], args, out)
    cmd = base + worker
    rc, text = _run_job(cmd, env)
    if rc != 0 or not out.exists():
        # Containers often forbid process_vm_readv (CMA), which vader uses for large messages.
        print("  mpirun failed; retrying without single-copy (CMA) transfers", flush=True)
        cmd = base + NO_CMA + worker
        rc, text = _run_job(cmd, env)
    if rc != 0 or not out.exists():
        return None, shlex.join(cmd), f"mpirun job failed (status {rc}):\n{text[-3000:]}"
    return json.loads(out.read_text()), shlex.join(cmd), ""


# ----------------------------------------------------------------------------- report

def _fmt_us(v):
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _fmt_ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def table(doc: dict) -> str:
    by = {(r["impl"], r["bytes"]): r for r in doc["results"]}
    sizes = sorted({r["bytes"] for r in doc["results"]})

    def get(impl, size, key):
        r = by.get((impl, size))
        return None if r is None else r[key]

    head = ["size", "ours us", "ours GB/s", "gloo us", "gloo GB/s", "mpi us", "mpi GB/s",
            "ours vs gloo", "ours vs mpi"]
    rows = []
    for s in sizes:
        cells = [human_bytes(s)]
        for impl in ALL_IMPLS:
            lat, bw = get(impl, s, "median_us"), get(impl, s, "algbw_GBps")
            bad = by.get((impl, s)) is not None and not by[(impl, s)]["correct"]
            cells += [_fmt_us(lat) + ("!" if bad else ""), "-" if bw is None else f"{bw:.3f}"]
        # bandwidth = bytes / median latency, so the bandwidth ratio ours/other equals the
        # latency ratio other/ours: one column is both ("x faster").
        cells.append(_fmt_ratio(get("gloo", s, "median_us"), get("smddp", s, "median_us")))
        cells.append(_fmt_ratio(get("mpi", s, "median_us"), get("smddp", s, "median_us")))
        rows.append(cells)
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("us: median latency per allreduce (slowest rank per iteration; best of the rounds' medians);")
    lines.append("GB/s: size / median latency (algorithm bandwidth);")
    lines.append("ours vs X: X's median latency / ours = our bandwidth / X's ('x faster'); ! = wrong result")
    va = doc.get("vector_add")
    if va:
        lines.append(f"vector add dst += src, {human_bytes(va['bytes'])}, 1 process: reduce_into "
                     f"{va['algbw_GBps']:.2f} GB/s of buffer ({va['memory_traffic_GBps']:.1f} GB/s of memory "
                     f"traffic), numpy.add {va['numpy_add_algbw_GBps']:.2f} GB/s of buffer")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.monotonic()
    notes: list[str] = []
    commands: list[str] = []
    results: list[dict] = []
    versions: dict = {}
    impls = list(args.impl_list)

    with tempfile.TemporaryDirectory(prefix="smddp_bench_") as tmpdir:
        tmp = Path(tmpdir)
        launcher_impls = [i for i in impls if i in ("smddp", "gloo")]
        if "gloo" in launcher_impls and _module_version("torch") is None:
            notes.append("gloo skipped: torch is not installed (pip install torch)")
            launcher_impls.remove("gloo")
            impls.remove("gloo")
        if launcher_impls:
            doc, cmd, err = run_smddprun_job(launcher_impls, args, tmp)
            commands.append(cmd)
            if doc is None:
                notes.append(err)
            else:
                results += doc["results"]
                versions.update(doc["versions"])
        if "mpi" in impls:
            doc, cmd, err = run_mpirun_job(args, tmp)
            if cmd:
                commands.append(cmd)
            if doc is None:
                notes.append("mpi skipped: " + err)
            else:
                results += doc["results"]
                versions.update(doc["versions"])
                if "btl_vader_single_copy_mechanism" in cmd:
                    notes.append("mpirun needed --mca btl_vader_single_copy_mechanism none (no CMA here)")

    print(f"$ (in this process) vector add of {human_bytes(VECTOR_ADD_BYTES)} with reduce_into", flush=True)
    vector_add = measure_vector_add(VECTOR_ADD_BYTES, seconds=0.2 if args.quick else 0.5)

    doc = {
        "benchmark": "allreduce float32 SUM, in place, CPU, one host",
        "timestamp_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "duration_s": round(time.monotonic() - t0, 1),
        "command": (shlex.join([sys.executable, *sys.argv]) if argv is None
                    else shlex.join(["allreduce_bandwidth.py", *argv])),
        "jobs": commands,
        "np": args.np,
        "impls": [i for i in ALL_IMPLS if any(r["impl"] == i for r in results)],
        "seconds_per_size": args.seconds,
        "rounds": args.rounds,
        "machine": machine_info(),
        "library_versions": versions,
        "vector_add": vector_add,
        "notes": notes,
        "results": results,
    }

    print()
    print(table(doc))
    for n in notes:
        print("note: " + n)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_name(out.name + ".json")
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {json_path}")
    if not args.no_plot:
        try:
            png = out.with_name(out.name + ".png")
            plot(doc, str(png))
            print(f"wrote {png}")
        except ImportError as e:
            print(f"no plot: {e} (pip install matplotlib)")

    wrong = [f"{r['impl']} {r['bytes']} B" for r in results if not r["correct"]]
    if wrong:
        print("WRONG RESULTS: " + ", ".join(wrong), file=sys.stderr)
        return 1
    if "smddp" in args.impl_list and not any(r["impl"] == "smddp" for r in results):
        return 1  # our own core must run; the peers may be missing
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
