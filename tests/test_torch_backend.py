"""The "smddp" torch.distributed backend: every collective x dtype against a single-process
computation, bad input and disagreeing ranks, sub-groups and a gloo group beside it."""
import functools
import json

import pytest

pytest.importorskip("torch")

from world import assert_all_ok, run_world  # noqa: E402

FAST_TIMEOUT = {"SMDDP_TIMEOUT": "5"}


def raised(result):
    return [e["message"] for e in result.events("raised")]


GROUPS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather_scatter",
          "send_recv", "barrier_and_misuse"]


@functools.lru_cache(maxsize=None)
def collectives_world(nranks):
    return run_world(nranks, "torch_collectives.py")


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("nranks", [2, 3])
def test_every_collective_and_dtype(nranks, group):
    """One world per size runs every family (tests/workers/torch_collectives.py); each family is
    a case here. all_reduce (every op), broadcast (every root), reduce, all_gather (list and
    tensor), reduce_scatter (list and tensor), all_to_all (single, even and uneven, and list),
    gather, scatter, send/recv, isend/irecv, batch_isend_irecv and barrier over every supported
    dtype; async_op=True through wait(), through get_future()/then() and by polling
    is_completed(); non-contiguous tensors (results copied back once); inputs dropped while an
    async call is in flight; a tensor on another device and unsupported dtypes."""
    for r in collectives_world(nranks):
        found = [c for c in r.events("checked") if c["collective"] == group]
        assert found, f"rank {r.rank} (exit {r.returncode}) never reported {group}:\n{r.output}"
        assert found[0]["ok"], f"rank {r.rank}, {group}:\n{found[0]['error']}"
        assert found[0]["cases"] > 0 and found[0]["world"] == nranks
        assert "terminate called" not in r.output, r.output


@pytest.mark.parametrize("nranks", [2, 3])
def test_every_collective_world_exits_cleanly(nranks):
    assert_all_ok(collectives_world(nranks))


@pytest.mark.parametrize(
    "case, nranks, expected",
    [
        ("shape", 2, ["disagree on the shape", "rank 0 has [4]", "rank 1 has [5]"]),
        ("shape", 3, ["disagree on the shape", "rank 0 has [4]", "rank 1 has [5]", "rank 2 has [6]"]),
        ("dtype", 2, ["disagree on the dtype", "rank 0 has float32", "rank 1 has float64"]),
    ],
    ids=["shape-2", "shape-3", "dtype-2"],
)
def test_disagreeing_ranks_raise_on_every_rank(case, nranks, expected):
    """Rank 0 all-reduces 4 elements, rank 1 five (rank 2 six): every rank raises (synchronously,
    through the future and through wait()) instead of hanging, and the group still works
    afterwards. The worker never calls destroy_process_group(), and must still exit cleanly."""
    results = run_world(nranks, "torch_errors.py", [case], env=FAST_TIMEOUT, timeout=120)
    assert_all_ok(results)
    for r in results:
        msgs = raised(r)
        assert len(msgs) == (3 if case == "shape" else 1), r.output
        for msg in msgs:
            assert all(fragment in msg for fragment in expected), msg
        r.event("usable")
        assert "terminate called" not in r.output, r.output


def test_calls_from_several_threads_in_a_fixed_order_are_exact():
    """The main thread, a long-lived helper, a fresh thread per round, and asynchronous calls
    still in flight when another thread calls, in an order the program fixes (as DDP's reducer
    on the autograd thread after the main thread's forward): every element exact."""
    results = run_world(3, "torch_threads.py", ["ordered"], timeout=120)
    assert_all_ok(results)
    for r in results:
        assert r.event("exact")["elements"] == 20 * 5 * 64


@pytest.mark.parametrize("backend", ["native", "python"])
@pytest.mark.parametrize("case", ["disorder", "handoff"])
def test_calls_that_reach_a_group_from_different_threads_raise_on_every_rank(case, backend):
    """torch.distributed calls carry no names: the k-th call of every rank is matched with the
    k-th of the others. Two threads whose calls reach the group in another order on rank 0 than
    on the others (disorder), or one call made by another thread on rank 0 (handoff), with
    tensors of one shape, would silently sum one thread's tensor with another's: every rank
    raises instead, naming each rank's calling thread, and the group still works. Both the C++
    Backend and the Python process group (SMDDP_TORCH_BACKEND=python) carry the thread."""
    results = run_world(3, "torch_threads.py", [case], env=dict(FAST_TIMEOUT, SMDDP_TORCH_BACKEND=backend),
                        timeout=120)
    assert_all_ok(results)
    for r in results:
        msgs = raised(r)
        assert len(msgs) == (2 if case == "disorder" else 1), r.output
        for msg in msgs:
            assert "ranks disagree on the calling thread" in msg, msg
            assert "SMDDP_CHECK_CALLING_THREAD=0" in msg, msg
        assert "rank 0 has thread 2, rank 1 has thread 3, rank 2 has thread 3" in msgs[0], msgs[0]
        r.event("usable")


def test_the_calling_thread_check_can_be_turned_off():
    """SMDDP_CHECK_CALLING_THREAD=0: a call handed to another thread in a fixed order (as a
    pool of several threads running one task at a time does) is matched by order alone."""
    results = run_world(3, "torch_threads.py", ["handoff"], env={"SMDDP_CHECK_CALLING_THREAD": "0"}, timeout=120)
    assert_all_ok(results)
    for r in results:
        assert r.event("exact")["elements"] == 64


@pytest.mark.parametrize("case, env", [("missing", {"SMDDP_TIMEOUT": "3"}), ("missing_explicit_timeout", {}),
                                       ("missing_at_start", {"SMDDP_TIMEOUT": "3"})],
                         ids=["SMDDP_TIMEOUT", "new_group-timeout", "first-collective"])
def test_missing_rank_times_out(tmp_path, case, env):
    """A rank that never joins a collective is named after SMDDP_TIMEOUT (which wins over torch's
    default timeout), or after the timeout given to new_group() (which wins over SMDDP_TIMEOUT;
    the world group then still works). Missing from the group's first collective (which starts
    the group's engine), it is named as not having joined."""
    results = run_world(3, "torch_errors.py", [case, str(tmp_path)], env=env, timeout=120)
    assert_all_ok(results)
    for r in results[:2]:
        msg = raised(r)[0]
        if case == "missing_at_start":
            assert "rank 2 did not join within 3 s" in msg, msg
        else:
            assert "submitted by rank(s) 0, 1 but rank(s) 2 did not submit it within 3 s" in msg, msg


def test_subgroups_and_gloo_beside_smddp():
    """new_group([0, 1]) and new_group([1, 2]) on 3 ranks: correct inside, NON_GROUP_MEMBER
    outside, overlapping groups in flight together, functional collectives by group name,
    destroying a sub-group; and a gloo group working beside the smddp world."""
    # No failure is expected here, so no short timeout: a rank outside a sub-group waits in
    # the next world collective for as long as the members take (slow on a loaded machine).
    results = run_world(3, "torch_groups.py")
    assert_all_ok(results)
    assert all("GROUPS OK" in r.stdout for r in results)


def test_groups_cost_nothing_until_first_used():
    """Eight groups (what pipeline x data parallel makes) are created without starting a thread,
    in well under a second; each one's engine (one thread) comes with its first collective,
    whose results are exact."""
    results = run_world(3, "torch_group_cost.py", timeout=120)
    assert_all_ok(results)
    for r in results:
        report = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("GROUP COST {"))[len("GROUP COST "):])
        assert report["threads_after_create"] == report["threads_before"], report
        assert report["create_s"] < 0.5, report
        # At most one thread per group used, its engine's: a group whose Works are only waited
        # on starts no completion thread (that comes with the first future).
        assert report["threads_after_use"] - report["threads_after_create"] <= report["member_of"], report
        assert "GROUP COST OK" in r.stdout


def test_split_groups_agree_on_their_keys():
    """A split child's store keys depend only on its members and their earlier splits: sibling
    groups handed one store (torch versions that named splits from a counter) each get their
    own engine, and members that made different numbers of other splits (a rank outside every
    split group is not asked by some torch versions) still meet."""
    results = run_world(4, "torch_split_siblings.py", timeout=120)
    assert_all_ok(results)
    assert all("SPLIT OK" in r.stdout for r in results)


@pytest.mark.parametrize("backend", ["native", "python"])
def test_cpu_collectives_while_the_default_device_is_elsewhere(backend):
    """torch.set_default_device to another device ("meta" here; "cuda" in scripts, run by the
    CUDA suite) must not put the backend's staging buffers there: CPU gathers, all_to_all,
    scatter and the object helpers give exact results."""
    results = run_world(3, "torch_default_device.py", ["meta"], env={"SMDDP_TORCH_BACKEND": backend}, timeout=120)
    assert_all_ok(results)
    assert all("DEFAULT DEVICE OK" in r.stdout for r in results)


@pytest.mark.parametrize("nranks", [2, 4])
def test_per_device_backend_api(nranks):
    """init_process_group(device_id=), _get_backend per device, new_group, 1-D and 2-D DeviceMesh
    with DTensor, destroy_process_group (split_group runs in the CUDA suite: torch splits only
    accelerator groups)."""
    results = run_world(nranks, "torch_backend_api.py", timeout=180)
    assert_all_ok(results)
    assert all("BACKEND API OK" in r.stdout for r in results)
