"""Bad sizes through torch.distributed on smddp (CPU tensors): a clear error on every rank,
never heap bytes sent to a peer, a crash or a silently wrong layout; the group keeps working.
"""
import sys

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401


def expect(fn, *needles):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in: {msg}"
        return msg
    raise AssertionError(f"expected an error containing {needles}")


def healthy(P):
    x = torch.ones(100)
    dist.all_reduce(x)
    assert torch.all(x == P), x[:4]


def main():
    dist.init_process_group("smddp")
    P, me = dist.get_world_size(), dist.get_rank()
    inp = torch.arange(4 * P, dtype=torch.float32)
    # Input splits that claim more rows than the input has (once: heap bytes went to the peer).
    expect(lambda: dist.all_to_all_single(torch.empty(8 * P), inp, [8] * P, [8] * P), "input split sizes", "add up")
    expect(lambda: dist.all_to_all_single(torch.empty(4 * P), inp, [4] * P, [1 << 40] + [0] * (P - 1)),
           "input split sizes")
    expect(lambda: dist.all_to_all_single(torch.empty(4 * P), inp, [4] * P, [-4, 8] + [4] * (P - 2)), "negative")
    healthy(P)
    # Output splits that disagree with what the senders send: every rank fails, naming the rank.
    out_splits = [4] * P
    if me == 1:
        out_splits = [3, 5] + [4] * (P - 2)
    expect(lambda: dist.all_to_all_single(torch.empty(4 * P), inp, out_splits, [4] * P),
           "rank 1 expects [3, 5", "they send [4, 4")
    healthy(P)
    # all_gather of inputs of different sizes into equal outputs: refused everywhere.
    x = torch.ones(5 + (1 if me == 0 else 0))
    expect(lambda: dist.all_gather([torch.empty(5) for _ in range(P)], x), "expects", "they send [6, 5")
    healthy(P)
    # all_gather_into_tensor with a too small output, on one rank only.
    out = torch.empty(3 * P - (1 if me == P - 1 else 0))
    if me == P - 1:
        expect(lambda: dist.all_gather_into_tensor(out, torch.ones(3)), "output has")
        dist.all_gather_into_tensor(torch.empty(3 * P), torch.ones(3))  # the call the others are in
    else:
        dist.all_gather_into_tensor(out, torch.ones(3))
    healthy(P)
    # A receive smaller than the message sent to it: the receiver fails with both sizes (nothing
    # written past its buffer); the matching send went out; the link keeps its order.
    if me == 0:
        dist.send(torch.ones(6), dst=1, tag=3)
        dist.send(torch.full((4,), 7.0), dst=1, tag=4)
    elif me == 1:
        small = torch.zeros(6)
        expect(lambda: dist.recv(small[:4], src=0, tag=3), "16 bytes", "rank 0 sent 24")
        assert torch.equal(small[4:], torch.zeros(2)), small
        nxt = torch.zeros(4)
        dist.recv(nxt, src=0, tag=4)
        assert torch.equal(nxt, torch.full((4,), 7.0)), nxt
    healthy(P)
    print(f"rank {me}: TORCH BAD INPUT OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
