"""The negotiation units in process, with no sockets and no engine thread: the response
cache (least-recently-used eviction, retired ids, replicas), the coordinator (readiness
order, fusion, mismatches, ragged sizes, stalls, ranks that left, ids announced after
their eviction) and the message codecs (layouts, malformed input). See native/messages.h."""
import struct

import pytest

from smdistributed._core import DType, OpType, ReduceOp, SmddpError
from smdistributed._core import negotiation as neg

NONE = neg.NO_CACHE_ID


def sig(shape=(4,), dtype=DType.float32, op=OpType.ALLREDUCE, **kw):
    return neg.Signature(op=op, dtype=dtype, shape=list(shape), **kw)


def full(name, s=None, per_rank=()):
    return neg.Announcement(name, s or sig(), list(per_rank))


# ---------------------------------------------------------------- response cache

def test_cache_evicts_the_least_recently_used_and_retires_its_id():
    c = neg.ResponseCache(2)
    a, ev = c.use("a", sig(), 1)
    b, ev2 = c.use("b", sig(), 1)
    assert (a, b, ev, ev2) == (0, 1, [], [])
    assert c.use("a", sig(), 2) == (a, [])          # a is now the most recently used
    cid, ev = c.use("c", sig(), 3)                   # full: b goes
    assert ev == [b] and cid == 2, (cid, ev)         # b's id is retired, not reused yet
    assert c.find("b", sig()) == NONE and c.find("a", sig()) == a and c.find("c", sig()) == cid
    assert c.resolve(b, 1)[0] == "b"                 # a rank that has not seen the eviction
    assert (c.size, c.retired, c.evictions) == (2, 1, 1)
    c.acknowledged(2)                                # everyone has applied message 2, not 3
    assert c.retired == 1
    c.acknowledged(3)
    assert c.retired == 0
    with pytest.raises(SmddpError, match="rank 2 announced response-cache id 1, which rank 0 never assigned"):
        c.resolve(b, 2)
    d, ev = c.use("d", sig(), 4)                     # a goes (c was used after it); b's id comes back
    assert ev == [a] and d == b and c.ids_made == 3


def test_cache_keys_are_name_and_signature():
    c = neg.ResponseCache(8)
    x4, _ = c.use("x", sig((4,)), 1)
    x5, _ = c.use("x", sig((5,)), 1)
    assert x4 != x5 and c.find("x", sig((4,))) == x4 and c.find("x", sig((5,))) == x5
    assert c.find("x", sig((4,), dtype=DType.float64)) == NONE


def test_cache_of_capacity_zero_never_assigns():
    c = neg.ResponseCache(0)
    assert c.use("a", sig(), 1) == (NONE, []) and c.size == 0


def test_replica_follows_learn_and_forget():
    r = neg.ResponseCache(0)  # replicas never evict on their own; capacity is rank 0's
    r.learn(3, "a", sig())
    assert r.find("a", sig()) == 3
    r.learn(3, "a", sig())    # idempotent
    r.forget(3)
    assert r.find("a", sig()) == NONE
    r.learn(5, "a", sig())
    r.learn(6, "a", sig())    # the same collective under a newer id
    assert r.find("a", sig()) == 6 and r.size == 1
    r.forget(5)               # an old id does not take the newer mapping with it
    assert r.find("a", sig()) == 6


# ---------------------------------------------------------------- coordinator

def everyone(coord, announcements_by_rank, applied=0, now=0):
    for rank, lst in enumerate(announcements_by_rank):
        coord.receive(rank, lst, applied, now)


def test_nothing_runs_until_every_rank_has_announced_then_in_readiness_order():
    c = neg.Coordinator(3, 16, stall_timeout=30)
    c.receive(0, [full("a"), full("b")], 0, 0)
    c.receive(1, [full("b"), full("a")], 0, 0)
    assert c.respond(1 << 20, 0).responses == [] and c.waiting == 2
    c.receive(2, [full("b")], 0, 0)
    c.receive(2, [full("a")], 0, 0)
    m = c.respond(1 << 20, 0)
    # Both are float32 sums: one fused bucket, in the order they became ready (b, then a).
    assert [r.names for r in m.responses] == [["b", "a"]]
    assert m.responses[0].cache_ids == [0, 1] and c.messages_built == 1 and c.waiting == 0


def test_fusion_respects_the_threshold_and_keeps_kinds_apart():
    c = neg.Coordinator(2, 16, stall_timeout=30)
    lst = [full("f1", sig((4,))), full("f2", sig((4,))), full("d1", sig((4,), DType.float64)),
           full("f3", sig((4,))), full("m1", sig((4,), reduce_op=ReduceOp.MAX)),
           full("b1", sig((4,), op=OpType.BROADCAST))]
    everyone(c, [lst, lst])
    m = c.respond(32, 0)  # two float32 x 4 per bucket
    assert [r.names for r in m.responses] == [["f1", "f2"], ["d1"], ["f3"], ["m1"], ["b1"]]


def test_check_only_entries_are_answered_and_cached_but_never_fused():
    c = neg.Coordinator(2, 16, stall_timeout=30)
    lst = [full("c1", sig(check_only=True)), full("c2", sig(check_only=True))]
    everyone(c, [lst, lst])
    m = c.respond(1 << 20, 0)
    assert [r.names for r in m.responses] == [["c1"], ["c2"]]
    assert all(r.cache_ids[0] != NONE for r in m.responses)


def test_check_only_gathers_carry_no_ragged_record():
    """The CUDA path's check-only allgather announces only its (engine-owned) capacity: the
    coordinator answers it without the ragged-size check that engine-run gathers get."""
    c = neg.Coordinator(2, 16, stall_timeout=30)
    g = sig((2,), op=OpType.ALLGATHER, check_only=True)
    everyone(c, [[full("cuda.all_gather#0", g, [-1])]] * 2)
    (r,) = c.respond(1 << 20, 0).responses
    assert not r.is_error and r.names == ["cuda.all_gather#0"], r.error


def test_a_mismatch_is_one_error_naming_the_field_and_every_rank():
    c = neg.Coordinator(3, 16, stall_timeout=30)
    everyone(c, [[full("y", sig((4,)))], [full("y", sig((4,)))], [full("y", sig((5,)))]])
    (r,) = c.respond(1 << 20, 0).responses
    assert r.is_error and r.names == ["y"] and r.cache_ids == [NONE]
    assert r.error == "ranks disagree on the shape of tensor 'y': rank 0 has [4], rank 1 has [4], rank 2 has [5]"
    assert c.cache.size == 0


def test_ragged_sizes_that_do_not_fit_a_receiver_are_an_error():
    c = neg.Coordinator(2, 16, stall_timeout=30)
    g = sig((3, 2), op=OpType.ALLGATHER)
    # per_rank: this rank's first dimension, then its output capacity in bytes (-1: engine-owned).
    c.receive(0, [full("g", g, [3, 5 * 2 * 4])], 0, 0)   # room for 5 rows of 2 floats
    c.receive(1, [full("g", sig((3, 2), op=OpType.ALLGATHER), [3, -1])], 0, 0)
    (r,) = c.respond(1 << 20, 0).responses
    assert r.is_error and "'g'" in r.error and "rank 0" in r.error, r.error
    c.receive(0, [full("h", g, [3, 6 * 2 * 4])], 0, 0)
    c.receive(1, [full("h", g, [3, -1])], 0, 0)
    (r,) = c.respond(1 << 20, 0).responses
    assert not r.is_error and r.per_rank == [[3, 48], [3, -1]]


def test_stalls_name_the_missing_ranks_after_the_timeout():
    c = neg.Coordinator(3, 16, stall_timeout=5)
    c.receive(0, [full("z")], 0, 0)
    c.receive(2, [full("z")], 0, 1_000_000)
    assert c.respond(1 << 20, 4_000_000).responses == []
    (r,) = c.respond(1 << 20, 5_500_000).responses
    assert r.is_error and r.names == ["z"]
    assert "submitted by rank(s) 0, 2 but rank(s) 1 did not submit it within 5 s" in r.error, r.error
    assert c.waiting == 0


def test_a_rank_that_left_fails_what_it_never_announced():
    c = neg.Coordinator(3, 16, stall_timeout=60)
    c.receive(0, [full("w")], 0, 0)
    c.receive(1, [full("w")], 0, 0)
    c.rank_left(2)
    (r,) = c.respond(1 << 20, 200_000).responses
    assert r.is_error and r.error == "rank(s) 2 shut down without submitting tensor 'w'"


def test_cached_announcements_resolve_to_the_same_responses():
    c = neg.Coordinator(2, 16, stall_timeout=30)
    everyone(c, [[full("a"), full("b")]] * 2)
    first = c.respond(1 << 20, 0).responses
    ids = dict(zip(first[0].names, first[0].cache_ids))
    c.receive(0, [neg.Announcement.by_id(ids["b"]), neg.Announcement.by_id(ids["a"])], 1, 0)
    c.receive(1, [neg.Announcement.by_id(ids["a"]), full("b")], 1, 0)  # a miss and a hit mix
    (r,) = c.respond(1 << 20, 0).responses
    assert r.names == ["a", "b"] and r.cache_ids == [ids["a"], ids["b"]]


def test_an_id_announced_after_its_eviction_still_means_what_it_meant():
    """Capacity 1. Message 1 gives 'a' id 0; message 2 evicts it for 'b'. Rank 1 announces
    'a' by id 0 before it has read message 2 (applied=1): rank 0 still resolves it, and does
    not give id 0 out again until rank 1 has applied message 2."""
    c = neg.Coordinator(3, 1, stall_timeout=30)
    everyone(c, [[full("a")]] * 3)
    (ra,) = c.respond(1 << 20, 0).responses
    assert ra.cache_ids == [0]
    everyone(c, [[full("b")]] * 3, applied=1)
    m2 = c.respond(1 << 20, 0)
    assert m2.evicted == [0] and m2.responses[0].cache_ids == [1]
    c.receive(0, [full("a")], 2, 0)
    c.receive(1, [neg.Announcement.by_id(0)], 1, 0)   # not yet seen message 2
    c.receive(2, [full("a")], 2, 0)
    m3 = c.respond(1 << 20, 0)
    assert m3.responses[0].names == ["a"] and not m3.responses[0].is_error
    assert m3.evicted == [1] and m3.responses[0].cache_ids == [2]   # id 0 is still retired
    everyone(c, [[full("c")]] * 3, applied=3)            # now every rank has applied 3
    m4 = c.respond(1 << 20, 0)
    assert m4.evicted == [2] and m4.responses[0].cache_ids[0] in (0, 1)
    assert c.cache.ids_made == 3


def test_an_id_given_and_evicted_in_one_message_is_not_kept_by_replicas():
    """Capacity 1, two new names in one message: 'a' gets id 0, then 'b' evicts it. A
    replica applies the evictions after the entries, so it keeps only 'b'."""
    c = neg.Coordinator(2, 1, stall_timeout=30)
    everyone(c, [[full("a"), full("b")]] * 2)
    m = c.respond(1 << 20, 0)
    assert [r.cache_ids for r in m.responses] == [[0, 1]] and m.evicted == [0]
    replica = neg.ResponseCache(0)
    for r in m.responses:
        for name, cid in zip(r.names, r.cache_ids):
            replica.learn(cid, name, sig())
    for cid in m.evicted:
        replica.forget(cid)
    assert replica.find("a", sig()) == NONE and replica.find("b", sig()) == 1


def test_protocol_violations_name_the_rank():
    c = neg.Coordinator(2, 4, stall_timeout=30)
    with pytest.raises(SmddpError, match="rank 1 announced response-cache id 7, which rank 0 never assigned"):
        c.receive(1, [neg.Announcement.by_id(7)], 0, 0)
    c.receive(1, [full("a")], 0, 0)
    with pytest.raises(SmddpError, match="rank 1 announced 'a' twice"):
        c.receive(1, [full("a")], 0, 0)
    with pytest.raises(SmddpError, match="rank 1 says it applied response 5, but rank 0 has built only 0"):
        c.receive(1, [], 5, 0)


# ---------------------------------------------------------------- messages

def test_announcements_round_trip_and_a_hit_is_a_few_bytes():
    lst = [full("grad.0", sig((2, 3), DType.bfloat16, splits=[1, 2], prescale=0.5), [7]),
           neg.Announcement.by_id(12, [1, 2])]
    blob = neg.encode_announcements(41, lst)
    applied, back = neg.decode_announcements(blob)
    assert applied == 41 and [a.name for a in back] == ["grad.0", ""]
    assert [a.cache_id for a in back] == [NONE, 12] and back[1].per_rank == [1, 2]
    # type + responses_applied + count + (id + empty per_rank): the whole of a cached announcement.
    assert len(neg.encode_announcements(0, [neg.Announcement.by_id(3)])) == 1 + 8 + 4 + 4 + 4
    assert blob[0] == 1 and struct.unpack_from("<QI", blob, 1) == (41, 2)


def test_responses_round_trip():
    c = neg.Coordinator(2, 1, stall_timeout=30)
    everyone(c, [[full("a")]] * 2)
    c.respond(1 << 20, 0)
    everyone(c, [[full("b"), full("z", sig((2,)), )]] * 2, applied=1)
    m = c.respond(1 << 20, 0)
    back = neg.decode_responses(neg.encode_responses(m))
    assert back.evicted == m.evicted == [0, 1]  # b evicted a, then z evicted b
    assert [r.names for r in back.responses] == [r.names for r in m.responses]
    assert [r.cache_ids for r in back.responses] == [r.cache_ids for r in m.responses]


@pytest.mark.parametrize("case", ["truncated", "lying count", "trailing", "huge per_rank"])
def test_malformed_messages_are_refused_before_allocating(case):
    good = neg.encode_announcements(0, [full("a")])
    blob = {
        "truncated": good[:-3],
        "lying count": bytes([1]) + struct.pack("<QI", 0, 0xFFFFFFF0),
        "trailing": good + b"x",
        "huge per_rank": bytes([1]) + struct.pack("<QIII", 0, 1, 3, 0x7FFFFFFF),
    }[case]
    with pytest.raises(SmddpError, match="malformed"):
        neg.decode_announcements(blob)
    with pytest.raises(SmddpError, match="malformed"):
        neg.decode_responses(bytes([2]) + struct.pack("<II", 0, 0x7FFFFFFF))


def test_protocol_version_is_the_one_the_rendezvous_checks():
    assert neg.PROTOCOL_VERSION == 5
