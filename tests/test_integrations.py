"""Clients that start the smddp backend themselves: PyTorch Lightning's DDPStrategy with
process_group_backend="smddp" under smddprun and torchrun (CPU), training equal to one
process. (Hugging Face's Trainer and accelerate put the model on CUDA with SageMaker's
data-parallel switch, so they are GPU-only.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

from world import free_port  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "lightning_ddp.py"


@pytest.mark.parametrize("launcher", ["smddprun", "torchrun"])
def test_lightning_ddp_strategy_on_smddp(launcher, tmp_path):
    if launcher == "smddprun":
        cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--", sys.executable, str(WORKER)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(WORKER)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", SMDDP_TIMEOUT="60"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("LIGHTNING OK") == 2, proc.stdout + proc.stderr
