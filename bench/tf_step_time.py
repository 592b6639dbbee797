"""TensorFlow training step time on CPU, 2 processes: DistributedGradientTape vs MultiWorkerMirroredStrategy.

    python bench/tf_step_time.py                  # both models, ~2-3 minutes on 2 cores
    python bench/tf_step_time.py --models cnn --steps 10 --rounds 1   # quick

Two jobs per model, one after the other, each of 2 processes on this host:
  1. smddprun -np 2 -- python bench/tf_step_time.py --role smddp ...
     times, in turns (--rounds rounds), the same tf.function training step with no gradient
     exchange at all (the floor) and with smdistributed's DistributedGradientTape; then the
     hand-off cost: the model's gradients reduced (a) by the engine alone, numpy arrays
     submitted together and awaited in Python, (b) through the TF frontend inside a
     tf.function (one tf.numpy_function op), less (c) the same tf.function call returning
     its inputs (what calling a function with that many tensors costs anyway) and less (a);
     (d) through the TF frontend eagerly, less (a);
  2. two processes with TF_CONFIG (two localhost ports), --role mwms: the same step under
     tf.distribute.MultiWorkerMirroredStrategy (collective ops, RING implementation).
Same model, same per-process batch, SGD, intra-op 1 / inter-op 2 threads per process.
A step's time is the slowest rank's; a configuration's figure is the median step of its
best round. Prints a table and writes bench/results/tf_cpu_2proc.json.

Models: "mlp" 6 x Dense(1448) + Dense(10) (12.6M parameters, 50 MB of float32 gradients,
bandwidth bound) and "cnn" the digits CNN of the examples (0.05M parameters, latency bound).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
JOB_TIMEOUT_S = 900


# ---- shared by both roles -------------------------------------------------------------------


def setup_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    return tf


def build_model(kind: str):
    import keras
    import numpy as np

    if kind == "mlp":
        layers = [keras.Input((1448,))] + [keras.layers.Dense(1448, activation="relu") for _ in range(6)]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
    else:
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(scale=0.02, size=w.shape).astype(np.float32) for w in model.get_weights()])
    return model


def make_batch(kind: str, size: int, rank: int):
    import numpy as np

    rng = np.random.default_rng(1 + rank)
    shape = (size, 1448) if kind == "mlp" else (size, 8, 8, 1)
    return rng.normal(size=shape).astype(np.float32), rng.integers(0, 10, size).astype(np.int64)


def time_step(step, args, steps: int, warmup: int) -> list:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step(*args)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def write_rank_result(out_dir: str, role: str, rank: int, data: dict) -> None:
    Path(out_dir, f"{role}.rank{rank}.json").write_text(json.dumps(data))


# ---- role: smddp (under smddprun) -------------------------------------------------------------


def run_smddp(args) -> None:
    tf = setup_tf()
    import keras
    import numpy as np

    import smdistributed.dataparallel.tensorflow as sdp
    from smdistributed.dataparallel.tensorflow.ops import reduce_tensors

    sdp.init()
    rank = sdp.rank()
    x, y = make_batch(args.model, args.batch, rank)
    x, y = tf.constant(x), tf.constant(y)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make_step(distributed: bool):
        model = build_model(args.model)
        opt = keras.optimizers.SGD(0.01)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if distributed:
                tape = sdp.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return step, model

    configs = {"no communication": False, "smdistributed DistributedGradientTape": True}
    steps = {name: make_step(d) for name, d in configs.items()}
    rounds = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (step, _) in steps.items():
            sdp.barrier()
            rounds[name].append(time_step(step, (x, y), args.steps, args.warmup))
    weights_sum = float(sum(np.abs(w).sum() for w in steps["smdistributed DistributedGradientTape"][1].get_weights()))

    # The hand-off: the same gradients, by the engine alone vs through the TF frontend.
    model = steps["no communication"][1]
    grads_np = [np.random.default_rng(rank).normal(size=v.shape).astype(np.float32)
                for v in model.trainable_variables]
    grads_tf = [tf.constant(g) for g in grads_np]
    core = sdp.runtime.core()
    outs = [np.empty_like(g) for g in grads_np]

    def engine_alone():
        works = [core.allreduce(g, "average", name=f"bench.handoff.{i}", out=o, async_op=True)
                 for i, (g, o) in enumerate(zip(grads_np, outs))]
        for w in works:
            w.wait()

    in_function = tf.function(lambda *gs: reduce_tensors(list(gs), op=sdp.ReduceOp.AVERAGE, kind="bench"))
    identity = tf.function(lambda *gs: [tf.identity(g) for g in gs])

    def through_function():
        in_function(*grads_tf)

    def function_call_alone():
        identity(*grads_tf)

    def eager():
        reduce_tensors(grads_tf, op=sdp.ReduceOp.AVERAGE, kind="bench_eager")

    handoff = {"engine alone (numpy, async + wait)": [], "tf.function call, identity (no reduction)": [],
               "TF frontend in tf.function": [], "TF frontend eager": []}
    fns = dict(zip(handoff, (engine_alone, function_call_alone, through_function, eager)))
    for _ in range(args.rounds):
        for name, fn in fns.items():
            sdp.barrier()
            handoff[name].append(time_step(fn, (), args.steps * 2, args.warmup))
    write_rank_result(args.out, "smddp", rank, {
        "rounds": rounds, "handoff": handoff, "weights_abs_sum": weights_sum,
        "gradients": len(grads_np), "gradient_bytes": int(sum(g.nbytes for g in grads_np)),
        "parameters": int(sum(g.size for g in grads_np)), "counters": core.counters(),
    })
    sdp.shutdown()


# ---- role: mwms (TF_CONFIG) --------------------------------------------------------------------


def run_mwms(args) -> None:
    tf = setup_tf()
    import keras
    import numpy as np

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    x, y = make_batch(args.model, args.batch, task)
    x, y = tf.constant(x), tf.constant(y)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction="none")
    with strategy.scope():
        model = build_model(args.model)
        opt = keras.optimizers.SGD(0.01)

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = loss_fn(y, model(x, training=True))
                # The global mean: this replica's share of the global batch.
                loss = tf.reduce_sum(per_example) / (args.batch * strategy.num_replicas_in_sync)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))  # sums gradients over workers
            return loss

        return strategy.run(replica_step, args=(x, y))

    rounds = {"tf.distribute MultiWorkerMirroredStrategy": []}
    for _ in range(args.rounds):
        rounds["tf.distribute MultiWorkerMirroredStrategy"].append(time_step(step, (x, y), args.steps, args.warmup))
    weights_sum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    write_rank_result(args.out, "mwms", task, {"rounds": rounds, "weights_abs_sum": weights_sum})


# ---- driver --------------------------------------------------------------------------------------


def worker_args(args, role: str, out: str) -> list:
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, "--model", args.model, "--out", out,
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--rounds", str(args.rounds)]


def run_jobs(args, out: str) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--"] + worker_args(args, "smddp", out)
    subprocess.run(cmd, check=True, timeout=JOB_TIMEOUT_S, env=env)
    from smdistributed.common.ports import free_listen_ports

    ports = free_listen_ports(2)
    procs = []
    for i in range(2):
        tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": i}}
        e = {k: v for k, v in env.items() if not k.startswith("SMDDP_")}
        e["TF_CONFIG"] = json.dumps(tf_config)
        procs.append(subprocess.Popen(worker_args(args, "mwms", out), env=e))
    for p in procs:
        if p.wait(timeout=JOB_TIMEOUT_S) != 0:
            raise SystemExit(f"the MultiWorkerMirroredStrategy job failed (exit {p.returncode})")


def best_median(per_rank_rounds: list) -> float:
    """Per step the slowest rank; per round the median; the best round."""
    medians = []
    for round_idx in range(len(per_rank_rounds[0])):
        steps = zip(*(r[round_idx] for r in per_rank_rounds))
        medians.append(statistics.median(max(s) for s in steps))
    return min(medians)


def summarize(args, out: str) -> dict:
    ranks = {role: [json.loads(Path(out, f"{role}.rank{r}.json").read_text()) for r in range(2)]
             for role in ("smddp", "mwms")}
    rows = {}
    for role in ("smddp", "mwms"):
        for name in ranks[role][0]["rounds"]:
            rows[name] = best_median([d["rounds"][name] for d in ranks[role]])
    handoff = {name: best_median([d["handoff"][name] for d in ranks["smddp"]]) for name in ranks["smddp"][0]["handoff"]}
    info = ranks["smddp"][0]
    return {"rows": rows, "handoff": handoff, "parameters": info["parameters"], "gradients": info["gradients"],
            "gradient_bytes": info["gradient_bytes"],
            "weights_abs_sum": {role: [d["weights_abs_sum"] for d in ranks[role]] for role in ranks}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp")
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=32, help="per-process batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--role", choices=["smddp", "mwms"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--results", default=str(RESULTS / "tf_cpu_2proc.json"))
    args = p.parse_args()
    if args.role == "smddp":
        run_smddp(args)
        return 0
    if args.role == "mwms":
        run_mwms(args)
        return 0

    import tensorflow as tf

    report = {"benchmark": "TensorFlow training step time on CPU, 2 processes",
              "command": " ".join(["python", "bench/tf_step_time.py"] + sys.argv[1:]),
              "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"nproc": os.cpu_count(), "processor": platform.processor() or platform.machine()},
              "tensorflow": tf.__version__, "batch_per_process": args.batch, "steps": args.steps,
              "rounds": args.rounds, "models": {}}
    for model in args.models.split(","):
        args.model = model.strip()
        with tempfile.TemporaryDirectory() as out:
            run_jobs(args, out)
            s = summarize(args, out)
        report["models"][args.model] = s
        rows, floor = s["rows"], s["rows"]["no communication"]
        mwms = rows["tf.distribute MultiWorkerMirroredStrategy"]
        ours = rows["smdistributed DistributedGradientTape"]
        print(f"\nmodel {args.model}: {s['parameters'] / 1e6:.2f}M parameters in {s['gradients']} gradients "
              f"({s['gradient_bytes'] / 2**20:.1f} MiB), batch {args.batch} per process, 2 processes")
        print(f"{'configuration':<45} {'step ms':>9} {'vs MWMS':>8} {'comm overhead ms':>17}")
        for name, t in rows.items():
            print(f"{name:<45} {t * 1e3:9.2f} {mwms / t:7.2f}x {(t - floor) * 1e3:17.2f}")
        print(f"ratio MWMS / DistributedGradientTape step time: {mwms / ours:.2f}")
        h = s["handoff"]
        alone = h["engine alone (numpy, async + wait)"]
        call = h["tf.function call, identity (no reduction)"]
        cost = {"tf.function (beyond the engine and the function call)": h["TF frontend in tf.function"] - call - alone,
                "eager (beyond the engine)": h["TF frontend eager"] - alone}
        print("hand-off (the same gradients reduced once; median per call):")
        for name, t in h.items():
            print(f"  {name:<45} {t * 1e3:8.3f} ms")
        for name, t in cost.items():
            print(f"  => hand-off cost, {name}: {t * 1e3:.3f} ms per step")
        s["ratio_mwms_over_smddp"] = mwms / ours
        s["handoff_cost_ms"] = {name: t * 1e3 for name, t in cost.items()}
    out = Path(args.results)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
