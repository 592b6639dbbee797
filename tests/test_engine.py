"""The engine's negotiation: order-independent matching, fusion, and the response cache."""
import json

import pytest

from world import assert_all_ok, run_world


def counters_of(result):
    line = next(l for l in result.stdout.splitlines() if l.startswith("COUNTERS "))
    return json.loads(line[len("COUNTERS "):])


@pytest.mark.parametrize("nranks", [2, 3])
def test_shuffled_batches_fuse_and_hit_the_cache(nranks):
    results = run_world(nranks, "fusion_and_cache.py", ["batch"])
    assert_all_ok(results)
    for r in results:
        steps = counters_of(r)
        for s in steps:
            assert s["completed"] == 50
            # All 50 (50 KB in all) become ready in one pass: one fused response, one round trip.
            assert s["responses"] == 1 and s["fused_responses"] == 1 and s["fused_tensors"] == 50, s
            assert s["negotiation_round_trips"] == 1, s
        # The first step announces in full; repeated steps announce every tensor by cache id.
        assert steps[0]["cache_misses"] == 50 and steps[0]["cache_hits"] == 0
        for s in steps[1:]:
            assert s["cache_hits"] == 50 and s["cache_misses"] == 0, s
    # A non-coordinator rank sends far less negotiation data once the cache is warm.
    worker_steps = counters_of(results[1])
    assert worker_steps[1]["negotiation_bytes"] < worker_steps[0]["negotiation_bytes"] / 2, worker_steps


@pytest.mark.parametrize("nranks", [2, 3])
def test_shuffled_stream_completes_correctly(nranks):
    results = run_world(nranks, "fusion_and_cache.py", ["stream"])
    assert_all_ok(results)
    for r in results:
        assert all(s["completed"] == 50 and s["failed"] == 0 for s in counters_of(r))
