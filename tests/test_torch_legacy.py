"""The older smdistributed.dataparallel.torch API, on real processes."""
import pytest

pytest.importorskip("torch")

from world import assert_all_ok, run_world  # noqa: E402


@pytest.mark.parametrize("nranks", [2, 3])
def test_legacy_functions(nranks):
    results = run_world(nranks, "torch_legacy.py", ["api"])
    assert_all_ok(results)
    assert all("LEGACY API OK" in r.stdout for r in results)


@pytest.mark.parametrize("case", ["ddp", "ddp-nosync", "ddp-unused", "ddp-buffers"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_legacy_ddp_matches_single_process(case, nranks):
    results = run_world(nranks, "torch_legacy.py", [case])
    assert_all_ok(results)
    assert all("LEGACY DDP OK" in r.stdout for r in results)


@pytest.mark.parametrize("resync", [False, True], ids=["5-steps", "each-step-from-equal-states"])
def test_legacy_ddp_equals_torch_ddp_step_by_step(resync):
    """The wrapper (and torch's DDP on smddp) against torch DDP on Gloo: gradients, parameters
    and buffers after each of 5 steps, every option the CPU path has (the GPU test runs the
    same worker against NCCL on ResNet-50, a transformer and an MLP). With `resync`, torch's
    copy takes the wrapper's state (parameters, buffers, momentum) before each step, as the
    GPU test does on more than 2 GPUs."""
    results = run_world(3, "torch_legacy_vs_nccl.py",
                        ["small-mlp", "default,nosync,unused,small-buckets,torch-ddp-smddp", "5"],
                        env={"SMDDP_TEST_RESYNC": "1"} if resync else None)
    assert_all_ok(results)
    for r in results:
        assert r.stdout.count("LEGACY VS NCCL OK") == 5, r.output


def test_legacy_ddp_leaves_the_group_fusion_threshold():
    """bucket_cap_mb no longer sets the process group's fusion threshold: another user of the
    group still fuses by the group's, and the wrapper sends one operation per bucket."""
    results = run_world(2, "torch_legacy.py", ["ddp-group-threshold"])
    assert_all_ok(results)
    assert all("LEGACY DDP OK" in r.stdout for r in results)
