"""DDP and FSDP on the smddp backend train exactly like one process on the whole batch."""
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from world import WORKERS, assert_all_ok, run_world  # noqa: E402

DDP_VARIANTS = ["default", "find_unused_parameters", "gradient_as_bucket_view", "static_graph", "no_sync",
                "broadcast_buffers", "allreduce_hook", "fp16_compress_hook"]


@pytest.mark.parametrize("nranks", [2, 3])
def test_ddp_matches_single_process(nranks):
    """5 SGD steps from different per-rank initial weights (DDP broadcasts rank 0's), each rank a
    slice of the global batch; parameters end equal on every rank and equal (relative 1e-5;
    2e-3 with fp16 compression) to one process training on the whole batch. With BatchNorm
    the buffers every forward sees are rank 0's (checked against a one-process simulation)."""
    results = run_world(nranks, "torch_ddp.py", DDP_VARIANTS)
    assert_all_ok(results)
    for r in results:
        done = re.findall(r"^VARIANT (\S+) OK", r.stdout, re.M)
        assert done == DDP_VARIANTS, r.output
        assert "DDP OK" in r.stdout


@pytest.mark.parametrize("nranks", [2, 3])
def test_fsdp_matches_single_process(nranks):
    """fully_shard (FSDP2) on CPU over smddp: 3 steps of a small MLP match one process
    (relative 1e-4); all-gathers and reduce-scatters go through smddp, uneven shards included."""
    results = run_world(nranks, "torch_fsdp.py")
    assert_all_ok(results)
    assert all("FSDP OK" in r.stdout for r in results)


def test_ddp_under_smddprun():
    """The same training started the way users start it: smddprun, then init_process_group
    ("smddp") with nothing else set up by the test."""
    proc = subprocess.run([sys.executable, "-m", "smdistributed.common.launcher", "-np", "2", "--",
                           sys.executable, str(WORKERS / "torch_ddp.py"), "default", "fp16_compress_hook"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        assert f"[{rank}] DDP OK" in proc.stdout, proc.stdout + proc.stderr
