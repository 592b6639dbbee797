"""Sub-groups on smddp, and a gloo group beside the smddp world, in one process (3 ranks).

Prints "GROUPS OK" when every check passed.
"""
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch_common import assert_same, make_input, reduce_reference


def check_subgroup(group, members, me, P):
    """Collectives inside `group` (global ranks `members`) against a single-process result."""
    if me not in members:
        # torch's behaviour for a rank outside the group: nothing happens, nothing hangs.
        assert group is dist.GroupMember.NON_GROUP_MEMBER, group
        assert dist.get_rank(group) == -1
        assert dist.get_world_size(group) == -1
        x = torch.full((4,), 7.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert dist.all_reduce(x, group=group) is None
            assert dist.broadcast(x, src=members[0], group=group) is None
            assert dist.barrier(group=group) is None
        assert torch.equal(x, torch.full((4,), 7.0)), "a non-member's tensor changed"
        return
    n = len(members)
    gr = members.index(me)
    assert dist.get_rank(group) == gr and dist.get_world_size(group) == n
    assert dist.get_backend(group) == "smddp", dist.get_backend(group)
    assert dist.get_process_group_ranks(group) == members

    for op in ("SUM", "MAX", "PRODUCT", "AVG"):
        inputs = {r: make_input(torch.float32, r, (11,), 1, op) for r in members}
        x = inputs[me].clone()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=group)
        assert_same(x, reduce_reference(torch.float32, op, [inputs[r] for r in members]), f"sub all_reduce {op}")

    inputs = {r: make_input(torch.int64, r, (5,), 2) for r in members}
    for src in members:  # broadcast's src is a global rank
        x = inputs[me].clone()
        dist.broadcast(x, src=src, group=group)
        assert_same(x, inputs[src], f"sub broadcast src={src}")
        x = inputs[me].clone()
        dist.broadcast(x, group_src=members.index(src), group=group)
        assert_same(x, inputs[src], f"sub broadcast group_src={members.index(src)}")

    outs = [torch.zeros(5, dtype=torch.int64) for _ in members]
    dist.all_gather(outs, inputs[me].clone(), group=group)
    for i, r in enumerate(members):
        assert_same(outs[i], inputs[r], f"sub all_gather part {i}")

    full = {r: make_input(torch.float64, r, (3 * n,), 3) for r in members}
    out = torch.zeros(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, full[me].clone(), group=group)
    want = reduce_reference(torch.float64, "SUM", [full[r] for r in members])[gr * 3:(gr + 1) * 3]
    assert_same(out, want, "sub reduce_scatter_tensor")

    dst = members[-1]
    x = inputs[me].clone()
    dist.reduce(x, dst=dst, group=group)
    if me == dst:
        assert_same(x, reduce_reference(torch.int64, "SUM", [inputs[r] for r in members]), "sub reduce")

    # point to point inside the group uses global ranks
    other = members[1 - gr] if n == 2 else None
    if other is not None:
        got = torch.zeros(5, dtype=torch.int64)
        if gr == 0:
            dist.send(inputs[me].clone(), dst=other, group=group)
            dist.recv(got, src=other, group=group)
        else:
            dist.recv(got, src=other, group=group)
            dist.send(inputs[me].clone(), dst=other, group=group)
        assert_same(got, inputs[other], "sub send/recv")

    # Functional collectives find the group through its registered name.
    assert group.group_name and group.group_name != dist.group.WORLD.group_name, group.group_name
    y = funcol.all_reduce(torch.full((2,), float(me)), "sum", group)
    assert_same(funcol.wait_tensor(y), torch.full((2,), float(sum(members))), "sub functional all_reduce")

    x = torch.full((3,), float(me))
    work = dist.all_reduce(x, group=group, async_op=True)
    work.get_future().then(lambda f: None).wait()
    assert_same(x, torch.full((3,), float(sum(members))), "sub async all_reduce")
    dist.barrier(group=group)


def main():
    dist.init_process_group(backend="smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    assert P == 3, "this worker is written for 3 ranks"
    assert dist.get_backend() == "smddp"

    # Every rank creates every group, members or not (torch's rule).
    sub01 = dist.new_group([0, 1])
    sub12 = dist.new_group([1, 2])
    gloo = dist.new_group(backend="gloo")
    assert dist.get_backend(gloo) == "gloo", dist.get_backend(gloo)

    check_subgroup(sub01, [0, 1], me, P)
    # The world keeps working between sub-group calls (its own engine, its own order).
    x = torch.full((2,), float(me + 1))
    dist.all_reduce(x)
    assert_same(x, torch.full((2,), float(sum(range(1, P + 1)))), "world all_reduce between sub-groups")
    check_subgroup(sub12, [1, 2], me, P)

    # Overlapping groups in flight at once: rank 1 is in both.
    a = torch.full((3,), float(me))
    b = torch.full((3,), float(me * 10))
    works = []
    if me in (0, 1):
        works.append(dist.all_reduce(a, group=sub01, async_op=True))
    if me in (1, 2):
        works.append(dist.all_reduce(b, group=sub12, async_op=True))
    w = torch.full((3,), 1.0)
    works.append(dist.all_reduce(w, async_op=True))
    for work in works:
        work.wait()
    if me in (0, 1):
        assert_same(a, torch.full((3,), 1.0), "sub01 concurrent")
    if me in (1, 2):
        assert_same(b, torch.full((3,), 30.0), "sub12 concurrent")
    assert_same(w, torch.full((3,), float(P)), "world concurrent")

    # gloo beside smddp: each through its own group, interleaved, and one in flight while the
    # other runs.
    for i in range(3):
        g = torch.full((4,), float(me + i))
        s = torch.full((4,), float(me * i))
        dist.all_reduce(g, group=gloo)
        dist.all_reduce(s)
        assert_same(g, torch.full((4,), float(sum(r + i for r in range(P)))), "gloo all_reduce")
        assert_same(s, torch.full((4,), float(sum(r * i for r in range(P)))), "smddp all_reduce")
    s = torch.full((1000,), float(me))
    work = dist.all_reduce(s, async_op=True)
    g = torch.full((10,), float(me))
    dist.broadcast(g, src=2, group=gloo)
    work.wait()
    assert_same(g, torch.full((10,), 2.0), "gloo broadcast")
    assert_same(s, torch.full((1000,), 3.0), "smddp all_reduce while gloo ran")

    # Destroying a sub-group leaves the world working.
    if me in (0, 1):
        dist.destroy_process_group(sub01)
    x = torch.ones(2)
    dist.all_reduce(x)
    assert_same(x, torch.full((2,), float(P)), "world after a sub-group was destroyed")

    dist.destroy_process_group()
    print("GROUPS OK", flush=True)


if __name__ == "__main__":
    main()
