"""The seeds' script shapes (examples/pytorch) run unchanged under smddprun, torchrun and mpirun."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from world import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "pytorch"
HANG_GUARD_S = 300


def run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env=dict(os.environ, SMDDP_TIMEOUT="30", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def check_training_output(out: str, checkpoint: Path):
    assert "epoch 1: loss" in out and "epoch 2: loss" in out and "samples/s on 2 processes" in out, out
    assert "test accuracy" in out, out
    assert checkpoint.exists()


@pytest.mark.parametrize("script", ["train_digits.py", "train_digits_legacy.py"])
def test_under_smddprun(script, tmp_path):
    ckpt = tmp_path / "model.pt"
    out = run([sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--", sys.executable,
               str(EXAMPLES / script), "--epochs", "2", "--save-model", str(ckpt)], tmp_path)
    check_training_output(out, ckpt)


def test_under_torchrun(tmp_path):
    ckpt = tmp_path / "model.pt"
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(EXAMPLES / "train_digits.py"), "--epochs", "2", "--save-model", str(ckpt)],
              tmp_path)
    check_training_output(out, ckpt)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_under_mpirun(tmp_path):
    ckpt = tmp_path / "model.pt"
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    out = run(cmd + [sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "2", "--save-model", str(ckpt)],
              tmp_path)
    check_training_output(out, ckpt)


ORIGINAL_ENV_PROGRAM = (
    "import os, smdistributed.dataparallel.torch.torch_smddp, torch.distributed as d; "
    "d.init_process_group('smddp'); "
    "os.write(1, ('ENV ' + ' '.join(os.environ[k] for k in ('SMDATAPARALLEL_RANK', 'SMDATAPARALLEL_SIZE', "
    "'SMDATAPARALLEL_LOCAL_RANK', 'SMDATAPARALLEL_LOCAL_SIZE')) + '\\n').encode()); "
    "d.destroy_process_group()"
)


@pytest.mark.parametrize("launcher", ["smddprun", "torchrun"])
def test_original_environment_variables(launcher, tmp_path):
    """SMDATAPARALLEL_* (what Hugging Face transformers reads under SageMaker's data-parallel
    switch) are set under smddprun (by the launcher) and torchrun (by importing torch_smddp)."""
    program = [sys.executable, "-c", ORIGINAL_ENV_PROGRAM]
    if launcher == "smddprun":
        cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--", *program]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "--no-python", *program]
    out = run(cmd, tmp_path)
    found = sorted(re.findall(r"ENV (\d+ \d+ \d+ \d+)", out))
    assert found == ["0 2 0 2", "1 2 1 2"], out
