"""The TensorFlow frontend on real processes: every API row against single-process results,
training equivalence, errors on every rank, and the seed / Horovod / Keras scripts under
smddprun. TensorFlow takes ~5 s to import per process, so checks are batched per process."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from world import assert_all_ok, run_world  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "tensorflow"
WORKERS = Path(__file__).parent / "workers"
HANG_GUARD_S = 300


@pytest.mark.parametrize("nranks", [2, 3])
def test_api(nranks):
    """Every API row (eager and tf.function), DistributedGradientTape / DistributedOptimizer /
    model.fit training against single-process training, TF1 graph mode, the Keras callbacks."""
    results = run_world(nranks, "tf_api.py", env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_all_ok(results)
    for r in results:
        assert "tf api ok" in r.stdout, r.output
        assert "CHECK train_seed ok" in r.stdout and "CHECK keras_fit ok" in r.stdout


def test_errors_raise_on_every_rank(tmp_path):
    """Shapes that differ between ranks (eager, tf.function, a tape) and a rank that never
    submits: every rank raises, and the engine stays usable."""
    results = run_world(2, "tf_api.py", ["errors", "missing"],
                        env={"SMDDP_TIMEOUT": "5", "SYNC_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_all_ok(results)
    for r in results:
        assert "CHECK errors ok" in r.stdout and "CHECK missing ok" in r.stdout, r.output


def test_dtype_codes_do_not_depend_on_history():
    """Rank 0 reduces a float64 tensor before a float32 + float64 group, rank 1 the group
    first: the dtype codes of the shapes check come from the core's DType, so both ranks code
    the group alike (codes numbered by first meeting made this a false mismatch)."""
    results = run_world(2, "tf_dtype_history.py", env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_all_ok(results)
    assert all("DTYPE HISTORY OK" in r.stdout for r in results)


def test_single_process_without_torch():
    """The frontend imports and trains with torch unimportable, in a plain `python` process
    (a world of one)."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError("No module named 'torch'")
        sys.meta_path.insert(0, NoTorch())
        import numpy as np, tensorflow as tf
        import smdistributed.dataparallel.tensorflow as sdp
        import smdistributed.dataparallel.tensorflow.keras as sdpk
        sdp.init()
        assert (sdp.size(), sdp.rank(), sdp.local_rank()) == (1, 0, 0)
        w = tf.Variable([1.0, 2.0])
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w)
            return sdp.DistributedGradientTape(tape).gradient(loss, [w])[0]
        np.testing.assert_allclose(step().numpy(), [2.0, 4.0])
        np.testing.assert_allclose(sdp.allreduce(tf.constant([3.0])).numpy(), [3.0])
        try:  # XLA cannot compile the numpy_function op: a clear error when traced
            tf.function(lambda: sdp.allreduce(tf.ones(2)), jit_compile=True)()
            raise AssertionError("expected an error under jit_compile=True")
        except RuntimeError as e:
            assert "jit_compile=False" in str(e), e
        sdp.shutdown(); sdp.shutdown()
        assert "torch" not in sys.modules
        print("no torch ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMDDP_", "OMPI_", "PMI_", "SLURM_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and "no torch ok" in proc.stdout, proc.stdout + proc.stderr


def smddprun(args, cwd):
    cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--", sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env=dict(os.environ, SMDDP_TIMEOUT="30", TF_CPP_MIN_LOG_LEVEL="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_seed_example_under_smddprun(tmp_path):
    """examples/tensorflow/train_digits.py: the documented TF2 script's shape, unchanged API."""
    pytest.importorskip("sklearn")
    out = smddprun([EXAMPLES / "train_digits.py", "--epochs", "3", "--checkpoint-dir", tmp_path / "ckpt"], tmp_path)
    assert "epoch 1: loss" in out and "epoch 3: loss" in out and "samples/s on 2 processes" in out, out
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0], out
    assert "test accuracy" in out
    assert list((tmp_path / "ckpt").glob("ckpt-1.index")), out


def test_keras_example_under_smddprun(tmp_path):
    """examples/tensorflow/train_digits_keras.py: model.fit with DistributedOptimizer and callbacks."""
    pytest.importorskip("sklearn")
    weights = tmp_path / "digits.weights.h5"
    out = smddprun([EXAMPLES / "train_digits_keras.py", "--epochs", "3", "--warmup-epochs", "1", "--save", weights],
                   tmp_path)
    assert "epoch 1: loss" in out and "epoch 3: loss" in out and "on 2 processes" in out, out
    assert "finished gradual learning rate warmup" in out and "test accuracy" in out, out
    assert weights.exists()


def test_horovod_script_with_only_the_import_changed(tmp_path):
    """A Horovod TF2 script (hvd.init, DistributedGradientTape, broadcast_variables after the
    first step, allreduce/allgather/broadcast_object/join) under smddprun."""
    pytest.importorskip("sklearn")
    out = smddprun([WORKERS / "tf_horovod_style.py"], tmp_path)
    sums = re.findall(r"rank (\d) of 2: weights checksum ([0-9.]+)", out)
    assert len(sums) == 2 and sums[0][1] == sums[1][1], out
    assert "Step #0" in out and "checkpoint saved" in out, out
    assert (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize("nranks", [2, 3])
def test_keras2_scripts(nranks):
    """Keras 2 scripts (tf-keras with TF_USE_LEGACY_KERAS=1): model.fit with the library's
    optimizer and callbacks equal to single-process training, the original TF2 Keras example's
    shape (no Input layer, experimental_run_tf_function, a SavedModel directory), a tape loop,
    and the consistency check."""
    pytest.importorskip("tf_keras")
    results = run_world(nranks, "tf_keras2.py", env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_all_ok(results)
    assert all("KERAS 2 OK" in r.stdout for r in results)
