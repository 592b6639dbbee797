"""Horovod's PyTorch API: `import smdistributed.dataparallel.torch as hvd` runs Horovod scripts."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from world import assert_all_ok, run_world  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch" / "horovod_digits.py"


@pytest.mark.parametrize("nranks", [2, 3])
def test_api_and_training_match_single_process(nranks):
    """Every collective (sync, async + synchronize/poll, in place) against single-process
    results; DistributedOptimizer training in pytorch_mnist.py's shape (with several backward
    passes, predivide, fp16 compression) equal to training on all ranks' batches in one process."""
    results = run_world(nranks, "torch_horovod.py")
    assert_all_ok(results)
    assert all("HOROVOD API OK" in r.stdout for r in results)


def test_horovod_pytorch_mnist_shape_trains_under_smddprun(tmp_path):
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--", sys.executable,
                           str(EXAMPLE), "--epochs", "4"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracies = [float(a) for a in re.findall(r"accuracy ([0-9.]+)%", proc.stdout)]
    assert len(accuracies) == 4 and accuracies[-1] > 50.0, proc.stdout
