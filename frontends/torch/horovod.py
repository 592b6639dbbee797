"""Horovod's PyTorch API on the smddp backend: `import smdistributed.dataparallel.torch as hvd`.

A `horovod.torch` script runs with only its import changed. Collectives go through
torch.distributed on the smddp process group (CPU tensors to the native engine, CUDA tensors
to NCCL). `DistributedOptimizer` hands each gradient to the engine by parameter name the moment
autograd has accumulated it (CPU), so reductions fuse and ranks need not produce gradients in
the same order; CUDA gradients are reduced asynchronously on the group's NCCL stream, in the
order backward produces them (as torch's DDP requires too).

Not supported, with a clear error: Adasum, process sets other than the global one, and
SyncBatchNorm on CPU tensors.
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from smdistributed import _core

# ---- world ---------------------------------------------------------------------------------


class ProcessSet:
    """Horovod's process sets; only the global one (every rank) exists here."""

    def __init__(self, ranks=None):
        if ranks is not None:
            raise NotImplementedError("process sets other than the global one are not supported")


global_process_set = ProcessSet()


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process sets other than the global one are not supported")


def init(comm=None, process_sets=None) -> None:
    """Joins the job (idempotent): the smddp process group of every rank."""
    if comm is not None:
        raise NotImplementedError("init(comm=...) (an MPI communicator) is not supported; launch with smddprun, "
                                  "torchrun or mpirun and call init()")
    if process_sets:
        raise NotImplementedError("process sets other than the global one are not supported")
    from . import torch_smddp  # noqa: F401  (registers the backend, fills torch's rendezvous variables)

    if not dist.is_initialized():
        dist.init_process_group("smddp")


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_initialized()


def _group():
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    from .parallel.distributed import _smddp_group

    return _smddp_group(None)


def size() -> int:
    return _group().size()


def rank() -> int:
    return _group().rank()


def local_rank() -> int:
    return _group().layout().local_rank


def local_size() -> int:
    return _group().layout().local_size


def cross_rank() -> int:
    return _group().layout().host_index


def cross_size() -> int:
    return _group().layout().num_hosts


def is_homogeneous() -> bool:
    sizes = allgather_object(local_size())
    return len(set(sizes)) == 1


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return not _core.gpu_unavailable_reason()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


# ---- reduce ops and compression ----------------------------------------------------------

class _Op:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name


Average, Sum, Adasum, Min, Max, Product = (_Op(n) for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product"))
_TORCH_OPS = {Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


def _resolve_op(op, average) -> _Op:
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass only one")
    if op is None:
        op = Average if average is None or average else Sum
    if op is Adasum:
        raise NotImplementedError("Adasum is not supported by smdistributed; use op=hvd.Average or hvd.Sum")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduce op {op!r}")
    return op


class _NoneCompressor:
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _FP16Compressor:
    """Floating tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    none = _NoneCompressor
    fp16 = _FP16Compressor


# ---- handles -------------------------------------------------------------------------------

class _Handle:
    def __init__(self, works, finish):
        self.works = [w for w in works if w is not None]
        self.finish = finish  # () -> the output, run once after the works
        self.done = False
        self.output = None


_handles: Dict[int, _Handle] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def _register(works, finish) -> int:
    with _handles_lock:
        h = next(_handle_ids)
        _handles[h] = _Handle(works, finish)
        return h


def poll(handle: int) -> bool:
    """True once the operation has finished (never blocks)."""
    entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle}")
    return entry.done or all(w.is_completed() for w in entry.works)


def synchronize(handle: int):
    """Waits for the operation and returns its output."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    for w in entry.works:
        w.wait()
    return entry.finish()


# ---- collectives ---------------------------------------------------------------------------

def _reduce_async(tensor: torch.Tensor, inplace: bool, op: _Op, compression, prescale: float,
                  postscale: float) -> int:
    """Reduces `tensor` (in place, or into a new tensor) asynchronously; returns a handle."""
    n = size()
    buf, ctx = compression.compress(tensor)
    if buf is tensor and not inplace:
        buf = tensor.clone()
    if prescale != 1.0:
        buf.mul_(prescale)
    # Average: a sum, then divided (with the postscale), as Horovod computes it.
    torch_op = dist.ReduceOp.SUM if op is Average else _TORCH_OPS[op]
    work = dist.all_reduce(buf, op=torch_op, async_op=True)

    def finish():
        result = compression.decompress(buf, ctx)
        if op is Average:
            if result.is_floating_point():
                result = result.mul_(postscale / n)
            else:
                result = result.div_(n, rounding_mode="trunc")
        elif postscale != 1.0:
            result = result.mul_(postscale)
        if inplace and result is not tensor:
            tensor.copy_(result)
            return tensor
        return result

    return _register([work], finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, compression=Compression.none) -> int:
    _check_process_set(process_set)
    return _reduce_async(tensor, False, _resolve_op(op, average), compression, prescale_factor, postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    _check_process_set(process_set)
    return _reduce_async(tensor, True, _resolve_op(op, average), Compression.none, prescale_factor,
                         postscale_factor)


class _AllreduceFunction(torch.autograd.Function):
    """Differentiable allreduce: the gradient is the same reduction of the output's gradient."""

    @staticmethod
    def forward(ctx, tensor, op, compression, prescale, postscale):
        ctx.args = (op, compression, prescale, postscale)
        return synchronize(_reduce_async(tensor, False, op, compression, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        op, compression, prescale, postscale = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(f"the gradient of an allreduce with op {op!r} is not defined")
        g = synchronize(_reduce_async(grad.contiguous(), False, op, compression, prescale, postscale))
        return g, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Returns the reduction of `tensor` over all ranks (Average by default); differentiable."""
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    return _AllreduceFunction.apply(tensor, op, compression, prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set, compression=Compression.none) -> int:
    hs = [allreduce_async(t, average, None, op, prescale_factor, postscale_factor, process_set, compression)
          for t in tensors]
    return _register([], lambda: [synchronize(h) for h in hs])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    hs = [allreduce_async_(t, average, None, op, prescale_factor, postscale_factor, process_set) for t in tensors]
    return _register([], lambda: [synchronize(h) for h in hs])


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set, compression))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def _rows(tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _gather_rows(n: int, device) -> List[int]:
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size())]
    dist.all_gather(counts, torch.tensor([n], dtype=torch.int64, device=device))
    return [int(c.item()) for c in counts]


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Concatenates every rank's tensor along dim 0; the first dimension may differ per rank."""
    _check_process_set(process_set)
    t = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    rows = _gather_rows(t.shape[0], t.device)
    most = max(rows)
    padded = t if t.shape[0] == most else torch.cat([t, t.new_zeros((most - t.shape[0],) + t.shape[1:])])
    parts = [torch.empty_like(padded) for _ in rows]
    work = dist.all_gather(parts, padded, async_op=True)
    return _register([work], lambda: torch.cat([p[:r] for p, r in zip(parts, rows)]))


def allgather(tensor, name=None, process_set=global_process_set):
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return [allgather(t, None, process_set) for t in tensors]


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    _check_process_set(process_set)
    _check_root(root_rank)
    work = dist.broadcast(tensor, root_rank, async_op=True)
    return _register([work], lambda: tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def _check_root(root_rank: int) -> None:
    if not 0 <= int(root_rank) < size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job of {size()} processes")


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    _check_process_set(process_set)
    P = size()
    rows = _rows(tensor)
    given = splits is not None
    if splits is None:
        if rows % P:
            raise ValueError(f"alltoall: dim 0 ({rows}) does not split evenly over {P} ranks; pass splits")
        splits = [rows // P] * P
    splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(splits) != P or min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"alltoall: splits {splits} must give one non-negative row count per rank ({P}) adding "
                         f"up to dim 0 ({rows})")
    # What each rank sends to this one, so the output can be sized.
    send = torch.tensor(splits, dtype=torch.int64, device=tensor.device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    received = [int(r) for r in recv.tolist()]
    out = tensor.new_empty((sum(received),) + tuple(tensor.shape[1:]))
    work = dist.all_to_all_single(out, tensor.contiguous(), received, splits, async_op=True)
    received_t = torch.tensor(received, dtype=torch.int32, device="cpu")
    return _register([work], lambda: (out, received_t) if given else out)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatters `splits[j]` rows to rank j; returns the rows received (and, when `splits` was
    given, how many came from each rank)."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor, name=None, compression=Compression.none, op=Average,
                        process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Reduces `tensor` over all ranks and keeps this rank's block of dim 0 (the first
    d0 % size ranks get one extra row, as in Horovod)."""
    _check_process_set(process_set)
    op = _resolve_op(op, None)
    P, me = size(), rank()
    rows = _rows(tensor)
    counts = [rows // P + (1 if r < rows % P else 0) for r in range(P)]
    row = tensor[0].numel() if tensor.dim() else 1
    buf, ctx = compression.compress(tensor.contiguous())
    buf = buf.clone() if buf is tensor else buf
    if prescale_factor != 1.0:
        buf.mul_(prescale_factor)
    ins = list(buf.reshape(-1).split([c * row for c in counts]))
    out = buf.new_empty(counts[me] * row)
    torch_op = dist.ReduceOp.SUM if op is Average else _TORCH_OPS[op]
    work = dist.reduce_scatter(out, ins, op=torch_op, async_op=True)

    def finish():
        result = compression.decompress(out, ctx).reshape((counts[me],) + tuple(tensor.shape[1:]))
        scale = postscale_factor / P if op is Average else postscale_factor
        return result.mul_(scale) if scale != 1.0 else result

    return _register([work], finish)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    return synchronize(reducescatter_async(tensor, name, compression, op, process_set, prescale_factor,
                                           postscale_factor))


def barrier(process_set=global_process_set) -> None:
    _check_process_set(process_set)
    dist.barrier()


def join(device=-1) -> int:
    """Waits until every rank has joined and returns the rank that joined last (by wall clock).
    Unlike Horovod, joined ranks do not stand in with zeros for collectives the others still
    run: every rank must have finished its collectives first."""
    times = allgather_object(time.time())
    return int(max(range(len(times)), key=lambda r: times[r]))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Pickles `obj` on `root_rank` and returns it on every rank."""
    _check_process_set(process_set)
    _check_root(root_rank)
    payload = pickle.dumps(obj) if rank() == root_rank else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device="cpu")
    dist.broadcast(length, root_rank)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(
        int(length.item()), dtype=torch.uint8, device="cpu")
    dist.broadcast(data, root_rank)
    return obj if rank() == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    _check_process_set(process_set)
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


# ---- parameters and optimizer state -------------------------------------------------------

def broadcast_parameters(params, root_rank: int) -> None:
    """Copies `root_rank`'s tensors into every rank's: `model.state_dict()`,
    `model.named_parameters()`, or a list of tensors or (name, tensor) pairs."""
    _check_root(root_rank)
    if isinstance(params, dict):
        tensors = list(params.values())
    else:
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    works = []
    with torch.no_grad():
        for t in tensors:
            if not torch.is_tensor(t):
                raise ValueError(f"broadcast_parameters: {type(t).__name__} is not a tensor")
            works.append(dist.broadcast(t.data, root_rank, async_op=True))
    for w in works:
        w.wait()


def broadcast_optimizer_state(optimizer, root_rank: int) -> None:
    """Every rank's optimizer takes `root_rank`'s state and hyperparameters."""
    _check_root(root_rank)
    state = broadcast_object(optimizer.state_dict(), root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


# ---- DistributedOptimizer -----------------------------------------------------------------

class _EngineWork:
    """One engine handle as a Work (keeps the gradient it reduces in place alive)."""

    def __init__(self, engine, handle: int, tensor: torch.Tensor):
        self._engine, self._handle, self._tensor = engine, handle, tensor

    def wait(self) -> None:
        self._engine.wait(self._handle, -1.0)

    def is_completed(self) -> bool:
        return self._engine.poll(self._handle)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed in front of the user's optimizer class (isinstance still holds)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(n, tuple) or len(n) != 2 for n in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, as "
                                 "model.named_parameters() gives")
            names = {id(p): n for n, p in named}
            if len(set(names.values())) != len(names):
                raise ValueError("parameter names in named_parameters must be unique")
            missing = [p for p in params if id(p) not in names]
            if missing:
                raise ValueError(f"named_parameters does not name {len(missing)} of the optimizer's parameters")
        else:
            names = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
        self._hvd_names = names
        self._hvd_op = _resolve_op(op, None)
        if self._hvd_op not in (Average, Sum):
            raise ValueError("DistributedOptimizer reduces gradients with op=Average or op=Sum")
        self._hvd_compression = compression
        self._hvd_passes = int(backward_passes_per_step)
        if self._hvd_passes < 1:
            raise ValueError("backward_passes_per_step must be at least 1")
        f = float(gradient_predivide_factor)
        if f != 1.0 and self._hvd_op is not Average:
            raise ValueError("gradient_predivide_factor applies only to op=Average")
        self._hvd_prescale, self._hvd_postscale = 1.0 / f, f
        self._hvd_delay = {id(p): self._hvd_passes for p in params}
        self._hvd_pending: Dict[int, tuple] = {}  # id(param) -> (param, reduce handle)
        self._hvd_skip = False
        self._hvd_params = params
        self._hvd_counter = itertools.count()
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hvd_hook)

    def _hvd_hook(self, p) -> None:
        if id(p) in self._hvd_pending:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before a step() or "
                "synchronize(); raise backward_passes_per_step to accumulate more passes")
        self._hvd_delay[id(p)] -= 1
        if self._hvd_delay[id(p)] == 0:
            self._hvd_pending[id(p)] = (p, self._hvd_reduce(p))

    def _hvd_reduce(self, p) -> int:
        """Starts the reduction of p's gradient (averaged over ranks and, with several passes, as
        Horovod does: the sum of the passes, averaged over ranks)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_cuda or self._hvd_compression is not Compression.none or grad.is_sparse:
            # NCCL path (ordered), or a compressed copy.
            return _reduce_async(grad, True, self._hvd_op, self._hvd_compression, self._hvd_prescale,
                                 self._hvd_postscale)
        # CPU: by name through the engine, so reductions fuse and their order does not matter.
        if not grad.is_contiguous():
            raise RuntimeError(f"the gradient of {self._hvd_names[id(p)]} is not contiguous")
        from .tensors import core_dtype

        engine = _group().engine
        average = self._hvd_op is Average
        # Horovod's predivide: grad / f summed, then * f / size (= the average).
        h = engine.submit(op=_core.OpType.ALLREDUCE, name=f"hvd.{self._hvd_names[id(p)]}", in_ptr=grad.data_ptr(),
                          out_ptr=grad.data_ptr(), count=grad.numel(), out_capacity=grad.numel() * grad.element_size(),
                          dtype=core_dtype(grad), shape=list(grad.shape),
                          reduce_op=_core.ReduceOp.AVERAGE if average else _core.ReduceOp.SUM,
                          prescale=self._hvd_prescale, postscale=self._hvd_postscale if average else 1.0)
        return _register([_EngineWork(engine, h, grad)], lambda: grad)

    def synchronize(self) -> None:
        """Waits for every gradient's reduction; parameters that got no gradient this step are
        reduced too (as zeros), so every rank runs the same reductions."""
        for p in self._hvd_params:
            if p.requires_grad and id(p) not in self._hvd_pending:
                self._hvd_pending[id(p)] = (p, self._hvd_reduce(p))
        pending, self._hvd_pending = self._hvd_pending, {}
        for _, (p, handle) in sorted(pending.items(), key=lambda kv: self._hvd_names[kv[0]]):
            synchronize(handle)
        for k in self._hvd_delay:
            self._hvd_delay[k] = self._hvd_passes

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For `optimizer.synchronize(); clip...; with optimizer.skip_synchronize(): optimizer.step()`."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        if not self._hvd_skip:
            self.synchronize()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd_pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(); that would lose the reductions "
                                 "in flight")
        return super().zero_grad(set_to_none=set_to_none)


_optimizer_classes: Dict[type, type] = {}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wraps a torch optimizer: gradients are averaged over all ranks before `step()`."""
    _check_process_set(process_set)
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = _optimizer_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
        _optimizer_classes[base] = cls
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # the same state, groups and hooks: no copy
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor)
    return wrapped


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """torch's SyncBatchNorm on the smddp group: statistics over every rank's batch (CUDA
    tensors, as torch's implementation requires)."""

    def forward(self, input):  # noqa: A002
        if self.training and not input.is_cuda:
            raise RuntimeError("SyncBatchNorm synchronizes statistics of CUDA tensors only (torch's implementation "
                               "needs them); on CPU use BatchNorm, whose statistics stay per rank")
        return super().forward(input)
