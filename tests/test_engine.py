"""The engine's negotiation: order-independent matching, fusion, and the response cache."""
import pytest

from world import assert_all_ok, run_world


def counters_of(result):
    return result.event("counters")["steps"]


# Cached collectives are agreed in hit cycles, peer to peer (SMDDP_HIT_EXCHANGE=1, the
# default), or by id through rank 0 (0): both paths are run.
HIT_EXCHANGE = [pytest.param("1", id="hit-cycles"), pytest.param("0", id="through-rank0")]


@pytest.mark.parametrize("hit_exchange", HIT_EXCHANGE)
@pytest.mark.parametrize("nranks", [2, 3])
def test_shuffled_batches_fuse_and_hit_the_cache(nranks, hit_exchange):
    results = run_world(nranks, "fusion_and_cache.py", ["batch"], env={"SMDDP_HIT_EXCHANGE": hit_exchange})
    assert_all_ok(results)
    for r in results:
        steps = counters_of(r)
        for s in steps:
            assert s["completed"] == 50
            # All 50 (50 KB in all) become ready in one pass: one fused response.
            assert s["responses"] == 1 and s["fused_responses"] == 1 and s["fused_tensors"] == 50, s
        # The first step announces in full, answered by one message from rank 0; repeated
        # steps find every tensor in the cache.
        assert steps[0]["cache_misses"] == 50 and steps[0]["cache_hits"] == 0
        assert steps[0]["negotiation_round_trips"] == 1, steps[0]
        for s in steps[1:]:
            assert s["cache_hits"] == 50 and s["cache_misses"] == 0, s
            if hit_exchange == "1":
                # No round trip through rank 0: the ranks' lists of ids meet in hit cycles
                # (one, or a few when a rank's batch arrives after a cycle began).
                assert s["negotiation_round_trips"] == 0 and 1 <= s["hit_cycles"] <= 2 * nranks, s
            else:
                assert s["negotiation_round_trips"] == 1 and s["hit_cycles"] == 0, s
    # A non-coordinator rank sends far less negotiation data once the cache is warm.
    worker_steps = counters_of(results[1])
    assert worker_steps[1]["negotiation_bytes"] < worker_steps[0]["negotiation_bytes"] / 2, worker_steps


@pytest.mark.parametrize("hit_exchange", HIT_EXCHANGE)
def test_a_small_response_cache_evicts_and_stays_exact(hit_exchange):
    """SMDDP_CACHE_CAPACITY=4 with a sliding working set of 5 names on 3 ranks: rank 0 evicts
    least recently used ids while other ranks may still list or announce them; every result
    is exact, and the cache both hits and evicts."""
    results = run_world(
        3, "fusion_and_cache.py", ["evict"], env={"SMDDP_CACHE_CAPACITY": "4", "SMDDP_HIT_EXCHANGE": hit_exchange}
    )
    assert_all_ok(results)
    for r in results:
        (s,) = counters_of(r)
        assert s["failed"] == 0 and s["completed"] == 40 * 5, s
        assert s["cache_evictions"] > 0 and s["cache_hits"] > 0, s


@pytest.mark.parametrize("hit_exchange", HIT_EXCHANGE)
@pytest.mark.parametrize("nranks", [2, 3])
def test_shuffled_stream_completes_correctly(nranks, hit_exchange):
    results = run_world(nranks, "fusion_and_cache.py", ["stream"], env={"SMDDP_HIT_EXCHANGE": hit_exchange})
    assert_all_ok(results)
    for r in results:
        assert all(s["completed"] == 50 and s["failed"] == 0 for s in counters_of(r))


def test_ranks_that_differ_on_hit_exchange_fail_with_a_clear_error():
    """SMDDP_HIT_EXCHANGE must be the same on every rank: once a cached collective makes the
    ranks that have it on list a hit, every rank fails naming the variable (no hang)."""
    results = run_world(2, "fusion_and_cache.py", ["stream"], per_rank_env={1: {"SMDDP_HIT_EXCHANGE": "0"}},
                        env={"SMDDP_TIMEOUT": "5"}, timeout=60)
    for r in results:
        assert r.returncode != 0, r.output
        assert "set SMDDP_HIT_EXCHANGE the same on every rank" in r.stderr, r.output
