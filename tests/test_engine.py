"""The engine's negotiation: order-independent matching, fusion, and the response cache."""
import json

from world import assert_all_ok, run_world


def counters_of(result):
    line = next(l for l in result.stdout.splitlines() if l.startswith("COUNTERS "))
    return json.loads(line[len("COUNTERS "):])


def test_shuffled_named_tensors_fuse_and_hit_the_cache():
    results = run_world(2, "fusion_and_cache.py")
    assert_all_ok(results)
    for r in results:
        steps = counters_of(r)
        for s in steps:
            assert s["completed"] == 50
            # Fusion: fewer responses than tensors, and some responses carried several.
            assert s["fused_responses"] >= 1, s
            assert s["responses"] < 50, s
        # The first step announces in full; repeated steps announce every tensor by cache id.
        assert steps[0]["cache_misses"] == 50
        for s in steps[1:]:
            assert s["cache_hits"] == 50 and s["cache_misses"] == 0, s
            # Caching never costs extra negotiation round trips.
            assert s["negotiation_round_trips"] <= steps[0]["negotiation_round_trips"], steps
    # A non-coordinator rank sends less negotiation data once the cache is warm.
    worker_steps = counters_of(results[1])
    assert worker_steps[1]["negotiation_bytes"] < worker_steps[0]["negotiation_bytes"] / 2, worker_steps


def test_three_ranks_shuffled():
    results = run_world(3, "fusion_and_cache.py")
    assert_all_ok(results)
