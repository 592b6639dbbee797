"""Hostile and careless input: a clear error on every rank involved, never a crash, a hang,
an out-of-bounds access or wrong data, and the engine usable for the next call."""
import functools

import pytest

from world import assert_all_ok, run_world

NUMPY_CASES = ["broadcast_into_smaller_output", "reduce_into_smaller_output", "read_only_arrays",
               "raw_submissions_with_wrong_sizes", "one_rank_output_too_small", "alltoall_output_too_small_on_one_rank",
               "dropped_async_handles", "unnamed_from_two_threads"]


@functools.lru_cache(maxsize=None)
def numpy_bad_input_world():
    return run_world(3, "bad_input.py")


@pytest.mark.parametrize("case", NUMPY_CASES)
def test_numpy_api_bad_input(case):
    """One world runs every case (tests/workers/bad_input.py), each a test case here: outputs too
    small (locally, and on one rank as only negotiation can tell), read-only buffers, sizes and
    splits that do not match the data, async handles dropped unfinished, unnamed calls from a
    second thread; after each, a correct allreduce shows the engine still works."""
    for r in numpy_bad_input_world():
        found = [c for c in r.events("case") if c["name"] == case]
        assert found, f"rank {r.rank} (exit {r.returncode}) never reported {case}:\n{r.output}"
        assert found[0]["ok"], f"rank {r.rank}, {case}:\n{found[0]['error']}"


def test_numpy_api_bad_input_world_exits_cleanly():
    results = numpy_bad_input_world()
    assert_all_ok(results)
    assert sorted(c["name"] for c in results[0].events("case")) == sorted(NUMPY_CASES)


def test_torch_bad_input():
    pytest.importorskip("torch")
    results = run_world(3, "torch_bad_input.py")
    assert_all_ok(results)
    assert all("TORCH BAD INPUT OK" in r.stdout for r in results)


@pytest.mark.parametrize("case", ["dead", "stalled"])
def test_torch_ddp_raises_when_a_peer_dies_or_stalls(case):
    """torch DDP's reducer sees the failure as an exception on every survivor (it crashed
    with SIGSEGV when a failed Work's future held the exception as a value)."""
    pytest.importorskip("torch")
    timeout = 5
    results = run_world(3, "torch_ddp_faults.py", [case], env={"SMDDP_TIMEOUT": str(timeout)},
                        kill_after_others=[2] if case == "stalled" else [], timeout=60)
    for r in results[:2]:
        assert r.returncode == 0, r.output
        e = r.event("raised")
        assert "rank 2" in e["message"] or "rank(s) 2" in e["message"], e["message"]
        assert e["after_s"] <= timeout + 2, e


@pytest.mark.parametrize("mode", ["announced", "cached", "p2p"])
@pytest.mark.parametrize("victim, hosts", [(0, 1), (2, 1), (0, 2), (3, 2)])
def test_stalled_rank_makes_every_other_rank_raise(victim, hosts, mode):
    """A stopped rank (the coordinator or not; one host, or two simulated hosts over TCP): the
    others raise within the timeout plus a second or two, naming it, whether the collective
    it misses is announced to rank 0 or a cache hit that a hit cycle waits on, or they wait
    on point-to-point receives from it (its engine no longer answers their pings; a peer that
    answers but does not send fails only the receive, test_recv_without_a_sender_fails_alone)."""
    timeout = 4
    args = [str(victim), mode]
    results = run_world(4, "stalled_peer.py", args, env={"SMDDP_TIMEOUT": str(timeout)}, hosts=hosts,
                        kill_after_others=[victim], timeout=60)
    for r in results:
        if r.rank == victim:
            continue
        assert r.returncode == 0, r.output
        e = r.event("raised")
        assert f"rank {victim}" in e["message"] or f"rank(s) {victim}" in e["message"], e["message"]
        if mode == "p2p":
            assert f"rank {victim} has not answered" in e["message"], e["message"]
        assert e["after_s"] <= timeout + 2.5, e


def test_recv_without_a_sender_fails_alone():
    """After the timeout the receive raises, naming the peer and tag; the engine goes on."""
    results = run_world(2, "p2p_orphan.py", env={"SMDDP_TIMEOUT": "3"}, timeout=60)
    assert_all_ok(results)
    for r in results:
        r.event("usable")
    e = results[1].event("raised")
    assert "recv from rank 0 with tag 99" in e["message"] and e["after_s"] < 6, e
