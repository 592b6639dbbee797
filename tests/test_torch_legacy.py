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
