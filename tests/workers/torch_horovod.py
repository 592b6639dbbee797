"""Horovod's PyTorch API (`import smdistributed.dataparallel.torch as hvd`) against
single-process results: every collective and its async form, and training with
DistributedOptimizer in the shape of Horovod's pytorch_mnist.py equal to training on the
concatenation of every rank's batches.
"""
import os
import sys

import torch
import torch.nn.functional as F

import smdistributed.dataparallel.torch as hvd

hvd.init()
P, R = hvd.size(), hvd.rank()
# SMDDP_TEST_DEVICE=cuda: the same checks on this rank's GPU (NCCL underneath).
if os.environ.get("SMDDP_TEST_DEVICE") == "cuda":
    torch.cuda.set_device(hvd.local_rank())
    DEVICE = torch.device("cuda", hvd.local_rank())
else:
    DEVICE = torch.device("cpu")


def expect(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in: {e}"
        return
    raise AssertionError(f"expected {exc.__name__}")


def per_rank(r, shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1000 + r)
    return torch.randint(-5, 6, shape, generator=g).to(dtype).to(DEVICE)


def check_world():
    assert hvd.is_initialized() and 0 <= R < P
    assert hvd.local_size() == P and hvd.local_rank() == R  # one host in the tests
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0 and hvd.is_homogeneous()
    assert not hvd.mpi_enabled() and not hvd.gloo_enabled()


def check_collectives():
    xs = [per_rank(r, (6, 3), 1) for r in range(P)]
    total = sum(xs)
    assert torch.equal(hvd.allreduce(xs[R], op=hvd.Sum), total)
    torch.testing.assert_close(hvd.allreduce(xs[R]), total / P)  # Average by default
    torch.testing.assert_close(hvd.allreduce(xs[R], average=True), total / P)
    assert torch.equal(hvd.allreduce(xs[R], op=hvd.Max), torch.stack(xs).max(0).values)
    assert torch.equal(hvd.allreduce(xs[R], op=hvd.Min), torch.stack(xs).min(0).values)
    torch.testing.assert_close(hvd.allreduce(xs[R], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), total)
    torch.testing.assert_close(hvd.allreduce(xs[R], compression=hvd.Compression.fp16), total / P)
    ints = [per_rank(r, (5,), 2, torch.int64) for r in range(P)]
    assert torch.equal(hvd.allreduce(ints[R], op=hvd.Sum), sum(ints))
    t = xs[R].clone()
    hvd.allreduce_(t, op=hvd.Sum)
    assert torch.equal(t, total)
    # Async forms: handles, poll, synchronize.
    handles = [hvd.allreduce_async(per_rank(R, (1000,), 10 + i), op=hvd.Sum, name=f"a{i}") for i in range(5)]
    assert all(hvd.poll(h) in (True, False) for h in handles)
    for i, h in enumerate(handles):
        got = hvd.synchronize(h)
        assert torch.equal(got, sum(per_rank(r, (1000,), 10 + i) for r in range(P)))
    t = xs[R].clone()
    assert torch.equal(hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum)), total) and torch.equal(t, total)
    got = hvd.grouped_allreduce([xs[R], 2 * xs[R]], op=hvd.Sum)
    assert torch.equal(got[0], total) and torch.equal(got[1], 2 * total)
    # Differentiable allreduce: d(sum of the average)/dx = 1 on every rank (the average of ones).
    x = xs[R].clone().requires_grad_()
    hvd.allreduce(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    # allgather with a different first dimension per rank.
    parts = [per_rank(r, (r + 1, 2), 3) for r in range(P)]
    assert torch.equal(hvd.allgather(parts[R]), torch.cat(parts))
    assert torch.equal(hvd.synchronize(hvd.allgather_async(parts[R])), torch.cat(parts))
    # broadcast (copy and in place).
    b = per_rank(R, (4,), 4)
    assert torch.equal(hvd.broadcast(b, root_rank=P - 1), per_rank(P - 1, (4,), 4))
    assert torch.equal(b, per_rank(R, (4,), 4))
    hvd.broadcast_(b, root_rank=0)
    assert torch.equal(b, per_rank(0, (4,), 4))
    expect(ValueError, lambda: hvd.broadcast(b, root_rank=P), "root_rank")
    # alltoall, even and with splits (rank s sends s+1 rows to every rank).
    even = per_rank(R, (2 * P, 3), 5)
    want = torch.cat([per_rank(s, (2 * P, 3), 5)[2 * R:2 * R + 2] for s in range(P)])
    assert torch.equal(hvd.alltoall(even), want)
    rows = torch.arange((R + 1) * P * 2, dtype=torch.float32, device=DEVICE).reshape(-1, 2) + 100 * R
    out, received = hvd.alltoall(rows, splits=[R + 1] * P)
    assert received.tolist() == [s + 1 for s in range(P)]
    want = torch.cat([(torch.arange((s + 1) * P * 2, dtype=torch.float32, device=DEVICE).reshape(-1, 2) + 100 * s)
                      [(s + 1) * R:(s + 1) * (R + 1)] for s in range(P)])
    assert torch.equal(out, want)
    # reducescatter: the first rows % P ranks get one extra row.
    full = [per_rank(r, (2 * P + 1, 2), 6) for r in range(P)]
    counts = [2 + (1 if r < 1 else 0) for r in range(P)]
    lo = sum(counts[:R])
    torch.testing.assert_close(hvd.reducescatter(full[R], op=hvd.Sum), sum(full)[lo:lo + counts[R]])
    torch.testing.assert_close(hvd.reducescatter(full[R]), (sum(full) / P)[lo:lo + counts[R]])
    # Objects, join, barrier, and what is refused.
    assert hvd.broadcast_object({"rank": R, "l": [1, 2]} if R == 1 else None, root_rank=1) == {"rank": 1, "l": [1, 2]}
    assert hvd.allgather_object(R * 10) == [r * 10 for r in range(P)]
    assert 0 <= hvd.join() < P
    hvd.barrier()
    expect(NotImplementedError, lambda: hvd.allreduce(xs[R], op=hvd.Adasum), "Adasum")
    expect(NotImplementedError, lambda: hvd.allreduce(xs[R], process_set=object()), "process sets")
    if DEVICE.type == "cpu":
        expect(RuntimeError, lambda: hvd.SyncBatchNorm(3)(torch.ones(4, 3)), "CUDA")
    else:  # statistics over every rank's batch
        bn = hvd.SyncBatchNorm(3).to(DEVICE)
        out = bn(per_rank(R, (4, 3), 7) + 0.5)
        allx = torch.cat([per_rank(r, (4, 3), 7) + 0.5 for r in range(P)])
        torch.testing.assert_close(bn.running_mean, 0.1 * allx.mean(0), rtol=1e-4, atol=1e-5)
        assert out.shape == (4, 3)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 6 * 6, 16)
        self.fc2 = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv(x))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def batch(r, step, n=4):
    g = torch.Generator().manual_seed(5000 + 31 * step + r)
    return torch.randn(n, 1, 8, 8, generator=g).to(DEVICE), torch.randint(0, 10, (n,), generator=g).to(DEVICE)


def train_like_pytorch_mnist(steps, passes=1, compression=hvd.Compression.none, predivide=1.0):
    """Horovod's pytorch_mnist.py loop: broadcast parameters and optimizer state from rank 0,
    DistributedOptimizer with named parameters, zero_grad/backward/step."""
    torch.manual_seed(100 + R)  # different initial weights per rank: the broadcast must fix them
    model = Net().to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, backward_passes_per_step=passes,
                                         gradient_predivide_factor=predivide)
    assert isinstance(optimizer, torch.optim.SGD)
    for step in range(steps):
        optimizer.zero_grad()
        for p in range(passes):
            x, y = batch(R, step * passes + p)
            F.nll_loss(model(x), y).backward()
        optimizer.step()
    return model


def reference(steps, passes=1):
    """One process: rank 0's initial model, each step on every rank's batches (the average of
    the per-rank mean losses, summed over the passes, as Horovod accumulates them)."""
    torch.manual_seed(100)
    model = Net().to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    for step in range(steps):
        optimizer.zero_grad()
        for p in range(passes):
            loss = sum(F.nll_loss(model(x), y) for x, y in (batch(r, step * passes + p) for r in range(P))) / P
            loss.backward()
        optimizer.step()
    return model


def compare(model, ref, tol, what):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what} {name}: {m}")


def check_training():
    compare(train_like_pytorch_mnist(5), reference(5), 1e-5, "DistributedOptimizer")
    compare(train_like_pytorch_mnist(3, passes=2), reference(3, passes=2), 1e-5, "backward_passes_per_step=2")
    compare(train_like_pytorch_mnist(3, predivide=2.0), reference(3), 1e-5, "gradient_predivide_factor=2")
    compare(train_like_pytorch_mnist(3, compression=hvd.Compression.fp16), reference(3), 2e-3, "fp16 compression")
    # zero_grad between backward and step would lose the reductions in flight: refused.
    model = Net().to(DEVICE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    F.nll_loss(model(batch(R, 0)[0]), batch(R, 0)[1]).backward()
    expect(AssertionError, opt.zero_grad, "before optimizer.step()")
    opt.step()
    expect(ValueError, lambda: hvd.DistributedOptimizer(opt), "already")


def main():
    for check in (check_world, check_collectives, check_training):
        check()
        print(f"CHECK {check.__name__} ok", flush=True)
    print(f"rank {R}: HOROVOD API OK", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
