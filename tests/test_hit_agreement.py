"""Hit cycles in process (native/hit_agreement.h): the peer-to-peer agreement on cached
collectives, with no sockets and no engine thread. Each test builds one HitAgreement per
rank and delivers every rank's kHits to every other rank, as the engine's control channels
do, then checks that all ranks decide the same thing: what runs and in which order, what is
dropped after an eviction, what the coordinator takes over, and stale listings."""
import pytest

from smdistributed._core import DType, OpType, SmddpError
from smdistributed._core import negotiation as neg


def sig(shape=(4,), dtype=DType.float32, op=OpType.ALLREDUCE):
    return neg.Signature(op=op, dtype=dtype, shape=list(shape))


class World:
    """n ranks' agreements over one cache (rank 0's table; replicas hold the same live ids)."""

    def __init__(self, n, names=("a", "b", "c", "d"), capacity=16):
        self.n = n
        self.cache = neg.ResponseCache(capacity)
        self.ids = {name: self.cache.use(name, sig(), 1)[0] for name in names}
        self.ranks = [neg.HitAgreement(n, r) for r in range(n)]

    def cycle(self, lists, applied=None, fusion_bytes=1 << 20, now=0):
        """Every rank lists lists[r] (names) in the next cycle; returns each rank's outcome."""
        msgs = []
        for r, names in enumerate(lists):
            ids = [self.ids[x] if isinstance(x, str) else x for x in names]
            msgs.append(self.ranks[r].begin(ids, (applied or [0] * self.n)[r], fusion_bytes if r == 0 else 0, now))
        for r, m in enumerate(msgs):
            for q in range(self.n):
                if q != r:
                    self.ranks[q].receive(r, m)
        return [a.complete(self.cache, now) for a in self.ranks]


def names_of(outcome):
    return [r.names for r in outcome["responses"]]


def test_an_id_every_rank_lists_runs_and_all_ranks_decide_alike():
    w = World(3)
    outs = w.cycle([["a", "b"], ["b", "a", "c"], ["a"]])
    # Only "a" is listed by all; "b" and "c" wait for the ranks that have not listed them.
    assert all(names_of(o) == [["a"]] for o in outs), outs
    outs = w.cycle([["c"], [], ["c", "b"]])
    # Both ready now, in the order rank 0 listed them (b in cycle 1, then c), fused.
    assert all(names_of(o) == [["b", "c"]] for o in outs), outs
    assert all(a.completed == 2 and a.listed == 0 and not a.open for a in w.ranks)


def test_ready_ids_fuse_by_rank_0s_threshold():
    w = World(2)
    outs = w.cycle([["a", "b", "c"], ["c", "b", "a"]], fusion_bytes=32)  # two float32 x 4 per bucket
    assert all(names_of(o) == [["a", "b"], ["c"]] for o in outs), outs


def test_a_rank_begins_a_cycle_another_rank_has_begun():
    w = World(2)
    a0, a1 = w.ranks
    m = a0.begin([w.ids["a"]], 0, 1 << 20, 0)
    assert not a1.should_begin(False)
    a1.receive(0, m)
    assert a1.should_begin(False) and a0.complete(w.cache, 0) is None  # rank 0 waits for rank 1
    assert a0.missing() == [1]
    a0.receive(1, a1.begin([], 0, 0, 0))  # rank 1 answers with an empty list
    assert a0.complete(w.cache, 0)["ran"] == [] and a1.complete(w.cache, 0)["ran"] == []


def test_a_listing_of_an_evicted_id_is_dropped_and_its_owner_told():
    w = World(2, capacity=4)
    w.cycle([["a"], []])
    _, evicted = w.cache.use("e", sig(), 2)  # the table is full: "a", least recently used, goes
    assert evicted == [w.ids["a"]] and w.cache.live_item(w.ids["a"]) is None
    for a in w.ranks:  # the response that evicts it, applied by both at the same point
        a.evicted(w.ids["a"])
    assert all(a.listed == 0 for a in w.ranks)  # rank 0's listing is gone: it announces in full
    # Rank 1 had not read the eviction when it listed "a": nothing runs, it must announce in full.
    outs = w.cycle([[], [w.ids["a"]]])
    assert [o["dropped"] for o in outs] == [[], [w.ids["a"]]] and all(o["ran"] == [] for o in outs)


def test_hand_over_takes_listings_and_forwards_later_ones_until_settled():
    w = World(3)
    w.cycle([["a"], ["a"], []], now=0)
    # Rank 0 decides: "a" has waited more than 1 s (or its name is contested).
    assert w.ranks[0].due_for_hand_over(2_000_000, 1_000_000) == [w.ids["a"]]
    assert w.ranks[0].due_for_hand_over(10, 1_000_000, ["a"]) == [w.ids["a"]]
    assert w.ranks[0].due_for_hand_over(10, 1_000_000) == []
    taken = [a.hand_over([w.ids["a"]]) for a in w.ranks]
    assert all(sorted(t) == [(0, w.ids["a"]), (1, w.ids["a"])] for t in taken), taken
    outs = w.cycle([[], [], ["a"]])  # the late rank's listing goes to the coordinator too
    assert all(o["forwarded"] == [(2, w.ids["a"])] and o["ran"] == [] for o in outs), outs
    for a in w.ranks:  # response 1 answers "a"
        a.settled("a", 1)
    outs = w.cycle([["a"], ["a"], ["a"]], applied=[1, 1, 1])  # the next "a" is a hit again
    assert all(names_of(o) == [["a"]] for o in outs), outs


def test_listings_made_before_a_response_answered_them_are_stale():
    w = World(2)
    w.cycle([["a"], []])
    for a in w.ranks:  # response 1 fails "a" (a stall error, say) while rank 0's listing waits
        a.settled("a", 1)
    assert all(a.listed == 0 for a in w.ranks)
    # Rank 1's listing was sent before it applied response 1: it belongs to the failed "a".
    outs = w.cycle([[], ["a"]], applied=[1, 0])
    assert all(o["ran"] == [] for o in outs) and all(a.listed == 0 for a in w.ranks)
    # Listed after applying it, it is a new "a".
    outs = w.cycle([["a"], ["a"]], applied=[1, 1])
    assert all(names_of(o) == [["a"]] for o in outs), outs


def test_only_answers_that_hits_were_part_of_are_remembered():
    """A response for a name no rank listed (announced in full everywhere, as names that never
    repeat are) leaves no record, so later listings of it count; an error response does, as a
    listing may still be on its way to the error that stalled on it."""
    w = World(2)
    for a in w.ranks:
        a.settled("b", 1)             # answered through rank 0 alone: nothing to remember
        a.settled("c", 1, failed=True)
    outs = w.cycle([["b", "c"], ["b", "c"]], applied=[0, 0])
    assert all(names_of(o) == [["b"]] for o in outs), outs  # "c" listings predate the error


def test_a_rank_that_left_counts_as_answered_and_everything_listed_is_handed_over():
    w = World(3)
    a0, a1, a2 = w.ranks
    a2.receive_goodbye(0)  # (ignored: a goodbye to itself is not possible; rank 0 is alive)
    for a in (a0, a1):
        a.receive_goodbye(2)
    m0, m1 = a0.begin([w.ids["a"]], 0, 1 << 20, 0), a1.begin([w.ids["a"]], 0, 0, 0)
    a0.receive(1, m1)
    a1.receive(0, m0)
    outs = [a.complete(w.cache, 0) for a in (a0, a1)]
    assert all(o["ran"] == [] for o in outs)  # rank 2 can never list it
    assert a0.due_for_hand_over(0, 1_000_000) == [w.ids["a"]]


def test_out_of_order_cycles_and_double_listings_are_refused_naming_the_rank():
    w = World(2)
    with pytest.raises(SmddpError, match="rank 1 sent hits for cycle 3 after cycle 0"):
        w.ranks[0].receive(1, neg.HitsMessage(3, []))
    w = World(2)
    a = w.ids["a"]
    with pytest.raises(SmddpError, match="rank 1 listed cached 'a' twice"):
        w.cycle([[], [a, a]])


def test_hits_messages_round_trip():
    m = neg.HitsMessage(7, [3, 1, 2], responses_applied=5, fusion_bytes=1 << 20)
    raw = neg.encode_hits(m)
    assert len(raw) == 1 + 8 + 8 + 8 + 4 + 3 * 4  # a hit costs 4 bytes
    back = neg.decode_hits(raw)
    assert (back.cycle, back.ids, back.responses_applied, back.fusion_bytes) == (7, [3, 1, 2], 5, 1 << 20)
    with pytest.raises(SmddpError, match="malformed|truncated|short"):
        neg.decode_hits(raw[:-2])
    r = neg.decode_responses(neg.encode_responses(neg.ResponseMessage(4, [9], [2])))
    assert (r.after_cycle, r.handed_over, r.evicted, r.responses) == (4, [9], [2], [])


def test_an_evicted_id_is_reused_only_after_the_next_cycle_completed():
    c = neg.ResponseCache(1)
    a, _ = c.use("a", sig(), seq=1, cycle=5)
    b, ev = c.use("b", sig(), seq=2, cycle=5)  # evicts a in message 2, after cycle 5
    assert ev == [a]
    c.acknowledged(2, 5)  # everyone applied message 2, but cycle 6 may still name a
    assert c.retired == 1
    c.acknowledged(2, 6)
    assert c.retired == 0
