"""Every collective x dtype x op through the native core, on real processes, against numpy.

One world per configuration runs every group of checks (tests/workers/collectives_matrix.py)
and reports each group's result; each (configuration, collective) pair is then its own test
case, so a failure names the collective and the configuration without a second run."""
import functools

import pytest

from world import run_world

# Small fusion threshold and staging slot so modest sizes cross both (multi-round, fused paths).
SMALL_BUFFERS = {"SMDDP_FUSION_THRESHOLD": "65536", "SMDDP_SHM_SLOT_BYTES": "65536", "SMDDP_SHM_RING_BYTES": "65536"}

# name: (ranks, simulated hosts, environment)
WORLDS = {
    # One host, staged through shared-memory slots (CMA off) and by cross-memory attach (auto).
    "2-ranks-staged": (2, 1, dict(SMALL_BUFFERS, SMDDP_CMA="0", SMDDP_CMA_THRESHOLD="4096")),
    "3-ranks-staged": (3, 1, dict(SMALL_BUFFERS, SMDDP_CMA="0", SMDDP_CMA_THRESHOLD="4096")),
    "2-ranks-cma": (2, 1, dict(SMALL_BUFFERS, SMDDP_CMA="auto", SMDDP_CMA_THRESHOLD="4096")),
    "3-ranks-cma": (3, 1, dict(SMALL_BUFFERS, SMDDP_CMA="auto", SMDDP_CMA_THRESHOLD="4096")),
    # 2 hosts x 2 ranks: shared memory inside a host, TCP between them, each algorithm.
    "2x2-hosts-auto": (4, 2, dict(SMALL_BUFFERS, SMDDP_ALGORITHM="auto", SMDDP_RING_THRESHOLD="4096")),
    "2x2-hosts-ring": (4, 2, dict(SMALL_BUFFERS, SMDDP_ALGORITHM="ring", SMDDP_RING_THRESHOLD="4096")),
    "2x2-hosts-hierarchical": (4, 2, dict(SMALL_BUFFERS, SMDDP_ALGORITHM="hierarchical", SMDDP_RING_THRESHOLD="4096")),
    # 3 ranks on 2 hosts (2 + 1): a host with a single rank, an odd ring.
    "2+1-hosts": (3, 2, dict(SMALL_BUFFERS, SMDDP_RING_THRESHOLD="4096")),
}
COLLECTIVES = ["allreduce", "broadcast_reduce", "allgather", "reduce_scatter", "alltoall", "p2p_and_barrier", "async"]


@functools.lru_cache(maxsize=None)
def world(name):
    nranks, hosts, env = WORLDS[name]
    return run_world(nranks, "collectives_matrix.py", env=env, hosts=hosts)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("name", list(WORLDS))
def test_collective(name, collective):
    nranks, hosts, _ = WORLDS[name]
    results = world(name)
    assert len(results) == nranks
    for r in results:
        found = [c for c in r.events("checked") if c["collective"] == collective]
        assert found, f"rank {r.rank} (exit {r.returncode}) never reported {collective}:\n{r.output}"
        (c,) = found
        assert c["ok"], f"rank {r.rank}, {collective}:\n{c['error']}"
        assert c["hosts"] == hosts


@pytest.mark.parametrize("name", list(WORLDS))
def test_every_rank_exits_cleanly(name):
    for r in world(name):
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}\n{r.output}"
