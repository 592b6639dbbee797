"""Data parallelism across model replicas (ddp: true): each partition's parameters start equal
on its data-parallel group, and its gradients are averaged over that group after each step
(started as soon as they are final, with overlapping_allreduce)."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .runtime import StepFailed


def broadcast_from_first(tensors: List[torch.Tensor], group, src: int) -> None:
    """Overwrites `tensors` with global rank `src`'s values (the dp group's first rank once
    after partitioning; the replica that trained longest after a join)."""
    for bucket in _buckets(tensors, 1 << 62):
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat, src, group=group)
        for t, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.data.copy_(v)


class GradBucket:
    """One bucket of a gradient reduction, with the methods of torch.distributed.GradBucket
    that communication hooks call (torch's class cannot be built from Python), so torch's own
    hooks (allreduce_hook, fp16_compress_hook, bf16_compress_hook, ...) run unchanged."""

    def __init__(self, index: int, count: int, params: List[torch.nn.Parameter], grads: List[torch.Tensor]):
        self._index, self._count, self._params, self._grads = index, count, params, grads
        self._buffer = _flatten_dense_tensors(grads)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self._params)

    def gradients(self) -> List[torch.Tensor]:
        return list(self._grads)


class _ReductionThread:
    """The one thread that issues gradient reductions (and runs communication hooks).

    A step's reduction starts on whichever thread finds the gradients final: a pipeline worker
    on one replica, the step's own thread on another. Collectives on a group are matched by
    the order of the calls, and the smddp backend checks that the k-th call came from the same
    thread on every rank (SMDDP_CHECK_CALLING_THREAD), since calls from racing threads would
    pair different tensors. Issuing every reduction from this one thread keeps that true, while
    the step's thread makes the data-parallel group's other calls (the first broadcast, join's
    announcements) in the program's order."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def run(self, fn: Callable[[], Any], device: torch.device) -> Any:
        """Runs `fn` on the reduction thread, with `device` current there (its kernels go to the
        device's default stream, as the pipeline's do), and returns its result (or raises its error)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="smp-grad-reduction", daemon=True)
                self._thread.start()
        done, box = threading.Event(), {}
        self._tasks.put((fn, device, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _serve(self) -> None:
        while True:
            fn, device, box, done = self._tasks.get()
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e
            done.set()
            fn = box = done = None  # held until the next task otherwise (its buckets, its result)


_reduction_thread = _ReductionThread()


class GradientReduction:
    """Averages the gradients of `params` over the data-parallel group, bucket by bucket.

    `launch()` starts every bucket's reduction without waiting: the pipeline runtime calls it as
    soon as this rank's gradients are final, which on every rank but the last to finish is
    before the step ends (overlapping_allreduce). `finish()` launches if that has not happened
    and waits. Every local parameter takes part (a missing gradient counts as zero) and buckets
    follow parameter order, so every replica reduces the same buckets in the same order, early
    or not. A communication hook, when registered, replaces the averaging of each bucket and
    returns a future of the reduced bucket, as under torch DDP."""

    def __init__(self, params: List[torch.nn.Parameter], group, dp_size: int, bucket_bytes: int,
                 hook: Optional[Callable] = None, hook_state: Any = None, zeros: bool = False):
        """`zeros`: a replica that has joined reduces zeros in place of its gradients."""
        self._params, self._group, self._dp_size, self._bucket_bytes = params, group, dp_size, bucket_bytes
        self._zeros = zeros
        self._hook, self._hook_state = hook, hook_state
        self._pending: Optional[List[Tuple[Any, GradBucket]]] = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self.launched_early = False

    def launch(self, early: bool = False) -> None:
        with self._lock:
            if self._pending is not None or self._error is not None:
                return
            try:
                device = self._params[0].device if self._params else torch.device("cpu")
                self._pending = _reduction_thread.run(self._start, device)
                self.launched_early = early
            except BaseException as e:  # surfaced by finish(), on the thread that owns the step
                self._error = e

    def finish(self) -> None:
        self.launch()
        if self._error is not None:
            raise self._error
        for work, bucket in self._pending:
            if self._hook is None:
                work.wait()
                reduced = bucket.buffer().div_(self._dp_size)
            else:
                reduced = work.wait()
                if isinstance(reduced, (list, tuple)):
                    reduced = reduced[0]
                if not isinstance(reduced, torch.Tensor) or reduced.numel() != bucket.buffer().numel():
                    raise RuntimeError(f"smp: the communication hook's future for bucket {bucket.index()} gave "
                                       f"{type(reduced).__name__}, not a tensor of the bucket's "
                                       f"{bucket.buffer().numel()} elements")
            if not self._zeros:
                for g, v in zip(bucket.gradients(), _unflatten_dense_tensors(reduced, bucket.gradients())):
                    g.copy_(v)

    def _start(self) -> List[Tuple[Any, GradBucket]]:
        if not self._zeros:
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        groups = _buckets(self._params, self._bucket_bytes)
        pending = []
        for i, params in enumerate(groups):
            grads = [torch.zeros_like(p) for p in params] if self._zeros else [p.grad for p in params]
            bucket = GradBucket(i, len(groups), params, grads)
            if self._hook is None:
                work = dist.all_reduce(bucket.buffer(), group=self._group, async_op=True)
            else:
                work = self._hook(self._hook_state, bucket)
                if not isinstance(work, (torch.futures.Future, torch._C.Future)):
                    raise TypeError(f"smp: a communication hook must return a torch.futures.Future, got "
                                    f"{type(work).__name__}")
            pending.append((work, bucket))
        return pending


def check_replicas_in_step(group, step_calls: int, who: str, members: List[int]) -> None:
    """The replicas' gradients are averaged only if every replica is at the same smp.step call.
    A replica whose step raised on it alone (a batch the microbatches do not divide, caught by
    the script) would otherwise pair its next step's buckets with the others' current ones,
    and every replica would train on that mix without an error. `group`: the data-parallel
    ranks, apart from the group the gradients travel on (a hook may use that from other threads)."""
    calls = torch.tensor([step_calls, -step_calls], dtype=torch.long)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=group)
    newest, oldest = int(calls[0]), -int(calls[1])
    if newest != oldest:
        raise StepFailed(f"{who}: the data-parallel replicas (global ranks {members}) reached the gradient "
                         f"reduction in different smp.step calls (this rank in call {step_calls}, the others "
                         f"between {oldest} and {newest}): a step failed on some replicas only, and the "
                         "gradients of different steps would have been averaged")


def reduction_failure(who: str, members: List[int], error: BaseException) -> str:
    """The reduction's error with the group's ranks translated: the engine names ranks by their
    position in the group it serves."""
    positions = ", ".join(f"rank {i} = global rank {g}" for i, g in enumerate(members))
    return (f"{who}: the gradient reduction over the data-parallel group of global ranks {members} failed "
            f"(in the error below, {positions}): {error}")


# Uneven inputs (DistributedModel.join): before each gradient reduction every replica says
# whether it still trains; one that has run out of batches answers 0 and takes part in that
# reduction with zero gradients, until every replica has answered 0. The sum is divided by
# the initial number of replicas, as torch DDP's join does by default. Joined replicas did not
# apply the last updates, so at the end the parameters and buffers of a replica that trained
# the most steps are broadcast to the others (as DDP's join does with the last joiner's model).
def announce(group, training: bool) -> int:
    flag = torch.tensor([1.0 if training else 0.0])
    dist.all_reduce(flag, group=group)
    return int(flag.item())


def shadow_until_all_joined(param_sets: List[List[torch.nn.Parameter]], buffers: List[torch.Tensor], group,
                            ranks: List[int], dp_size: int, bucket_bytes: int, steps: int, step_calls: int,
                            hook: Optional[Callable] = None, hook_state: Any = None) -> int:
    """`param_sets`: the reductions a training replica makes each step, in its order. Returns
    the largest count of smp.step calls among the replicas, which all continue from."""
    while announce(group, training=False) > 0:
        for params in param_sets:
            GradientReduction(params, group, dp_size, bucket_bytes, hook, hook_state, zeros=True).finish()
    params = [p for s in param_sets for p in s]
    counts = [torch.zeros(2, dtype=torch.int64) for _ in ranks]
    dist.all_gather(counts, torch.tensor([steps, step_calls], dtype=torch.int64), group=group)
    steps_done = [int(c[0]) for c in counts]
    source = ranks[steps_done.index(max(steps_done))]
    broadcast_from_first([*params, *buffers], group, source)
    return max(int(c[1]) for c in counts)


def _buckets(tensors: List[torch.Tensor], limit: int) -> List[List[torch.Tensor]]:
    """Consecutive tensors of one device and dtype, up to `limit` bytes a bucket."""
    out: List[List[torch.Tensor]] = []
    open_: Dict[Tuple[torch.device, torch.dtype], Tuple[List[torch.Tensor], int]] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        bucket, size = open_.get(key, ([], 0))
        n = t.numel() * t.element_size()
        if bucket and size + n > limit:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append(t)
        open_[key] = (bucket, size + n)
    out.extend(b for b, _ in open_.values() if b)
    return out
