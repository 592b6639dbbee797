"""Every collective x dtype x op through the native core, on real processes, against numpy."""
import pytest

from world import assert_all_ok, run_world

# Small fusion threshold and staging slot so modest sizes cross both (multi-round, fused paths).
SMALL_BUFFERS = {"SMDDP_FUSION_THRESHOLD": "65536", "SMDDP_SHM_SLOT_BYTES": "65536", "SMDDP_SHM_RING_BYTES": "65536"}


@pytest.mark.parametrize("cma", ["0", "auto"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_one_host(nranks, cma):
    """Staged through shared-memory slots (CMA off) and by cross-memory attach (auto)."""
    env = dict(SMALL_BUFFERS, SMDDP_CMA=cma, SMDDP_CMA_THRESHOLD="4096")
    results = run_world(nranks, "collectives_matrix.py", env=env)
    assert_all_ok(results)
    assert all("all collectives ok, hosts=1" in r.stdout for r in results)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "hierarchical"])
def test_two_simulated_hosts(algorithm):
    """2 hosts x 2 ranks: shared memory inside a host, TCP between them."""
    env = dict(SMALL_BUFFERS, SMDDP_ALGORITHM=algorithm, SMDDP_RING_THRESHOLD="4096")
    results = run_world(4, "collectives_matrix.py", env=env, hosts=2)
    assert_all_ok(results)
    assert all("all collectives ok, hosts=2" in r.stdout for r in results)


def test_three_hosts_uneven():
    """3 ranks on 2 hosts (2 + 1): a host with a single rank, an odd ring."""
    results = run_world(3, "collectives_matrix.py", env=dict(SMALL_BUFFERS, SMDDP_RING_THRESHOLD="4096"), hosts=2)
    assert_all_ok(results)
