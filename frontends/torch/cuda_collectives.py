"""CUDA tensors on the smddp backend: every collective through the core's NCCL data plane.

Tensors reach the core as device pointers. Each call orders the group's stream after the
caller's current stream, enqueues NCCL (and any packing or unpacking) there, and returns a
CudaWork whose wait() makes the caller's stream wait on the GPU; the host never blocks.
Tensors the group's stream uses are recorded on it, so the caching allocator does not hand
their memory out again before NCCL is done with it.

Point-to-point sends and receives are held back and launched together, as one NCCL group,
when any of them is waited on or another collective starts. NCCL needs the send and the
receive of a pair in flight at once; launched one by one, a rank that posts its receive
before its send (legal with isend/irecv) would block its own stream.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from smdistributed import _core

from . import collective_args as args
from .tensors import core_dtype

CoreOp = _core.ReduceOp
OpType = _core.OpType


def nccl_unavailable_reason() -> str:
    return _core.gpu_unavailable_reason()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: torch.device) -> int:
    """The caller's current stream on `device`, as the raw cudaStream_t integer."""
    if _raw_stream is not None:
        return _raw_stream(device.index)  # no Stream object: this is on every call's path
    return torch.cuda.current_stream(device).cuda_stream


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else 0


class CudaWork(dist.Work):
    """The end of one collective on the group's stream, as torch's Work and Future."""

    def __init__(self, group: "CudaCollectives", event, result):
        super().__init__()
        self._group = group
        self._event = event  # None while a held-back point-to-point operation is unlaunched
        self._result = result

    def _launched(self):
        if self._event is None:
            self._group.flush_p2p()
        return self._event

    def _check(self):
        error = self._group.nccl.error()
        if error:
            raise RuntimeError(f"smddp: {error}")

    def wait(self, timeout=None) -> bool:
        self._launched().block(current_stream(self._group.device))
        self._check()
        return True

    def synchronize(self) -> None:
        self._launched().synchronize()
        self._check()

    def is_completed(self) -> bool:
        return self._launched().query()

    def is_success(self) -> bool:
        return self.is_completed() and not self._group.nccl.error()

    def exception(self):
        error = self._group.nccl.error()
        return RuntimeError(f"smddp: {error}") if error else None

    def result(self):
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        # A CUDA future: completing it on the group's stream records its events there, so
        # whoever reads the value (DDP's hooks included) waits on the GPU, not the host.
        self._launched()
        future = torch.futures.Future(devices=[self._group.device])
        with torch.cuda.stream(self._group.stream):
            future.set_result(self._result)
        return future


def gpu_identity(device: torch.device) -> str:
    """What tells two ranks' GPUs apart: the device's UUID (ranks that see different device
    indices, CUDA_VISIBLE_DEVICES set per rank, can still be on one GPU)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def ranks_sharing_gpus(store, key: str, rank: int, size: int, device: torch.device) -> List[List[int]]:
    """The sets of this group's ranks that are on one GPU (empty when each has its own). Each
    rank posts its GPU and reads the others' through the group's store: every rank of the group
    must call it, at the same point (its first CUDA collective)."""
    mine = gpu_identity(device)
    store.set(f"{key}/gpu/{rank}", mine)
    on = {}
    for r in range(size):
        gpu = mine if r == rank else store.get(f"{key}/gpu/{r}").decode()
        on.setdefault(gpu, []).append(r)
    return [ranks for ranks in on.values() if len(ranks) > 1]


def _refuse_shared_gpus(store, key: str, rank: int, size: int, device: torch.device) -> None:
    """A clear error, on every rank, when two ranks of the group are on one GPU: NCCL refuses
    such a communicator with a bare 'invalid usage'. (The process group stages such groups'
    collectives through host memory instead, host_staging.py; the older DistributedDataParallel,
    which makes its own communicator, raises this.)"""
    shared = ranks_sharing_gpus(store, key, rank, size, device)
    if shared:
        pairs = "; ".join(", ".join(map(str, ranks)) for ranks in shared)
        raise RuntimeError(f"smddp: ranks {pairs} of this group are on one GPU, and NCCL runs no collective "
                           "between two ranks of one device. Give each rank its own GPU (as many GPUs as ranks on "
                           "a host, each rank on torch.cuda.set_device(local_rank)), or use CPU tensors")


class CudaCollectives:
    """One NCCL communicator of a process group, on one device."""

    def __init__(self, store, rank: int, size: int, device: torch.device, timeout_s: float, key: str = "smddp/nccl",
                 max_ctas: Optional[int] = None):
        reason = nccl_unavailable_reason()
        if reason:
            raise RuntimeError(f"smddp: CUDA tensors need NCCL: {reason}")
        _refuse_shared_gpus(store, key, rank, size, device)
        if rank == 0:
            store.set(key, _core.nccl_unique_id())
        unique_id = store.get(key)
        self.rank, self.size, self.device = rank, size, device
        self.nccl = _core.NcclGroup(
            unique_id, rank, size, device.index, max_ctas=max_ctas or _env_int("SMDDP_NCCL_MAX_CTAS"),
            min_ctas=_env_int("SMDDP_NCCL_MIN_CTAS"), timeout=timeout_s)
        self.stream = torch.cuda.ExternalStream(self.nccl.stream, device=device)
        self._p2p = []  # held-back (is_send, caller's tensor, contiguous buffer, peer, work)
        self._engine = None

    def check_arguments_with(self, engine) -> None:
        """Every later collective's arguments are also negotiated through `engine` (the group's
        CPU engine, check_only): ranks that disagree on shape, dtype, op or root, or a rank that
        dies, make the communicator abort with a message naming what differs, on every rank."""
        self._engine = engine
        self.nccl.attach_engine(engine)

    def _verify(self, op, t: torch.Tensor, kind: str, reduce=CoreOp.SUM, root: int = 0, shape=None) -> None:
        if self._engine is not None:
            self.nccl.check(kind, op, core_dtype(t), list(t.shape) if shape is None else shape, reduce, root)

    # -- launching --------------------------------------------------------------------------
    def check(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        for t in tensors:
            if t.device != self.device:
                raise RuntimeError(f"smddp {what}: tensor is on {t.device}, but this group's NCCL communicator "
                                   f"is on {self.device} (one device per process and group)")
            if t.is_sparse:
                raise RuntimeError(f"smddp {what}: sparse tensors are not supported")
            core_dtype(t)

    def begin(self) -> None:
        if self._p2p:
            self.flush_p2p()
        self.nccl.wait_for(current_stream(self.device))

    def end(self, used: Sequence[torch.Tensor], result) -> CudaWork:
        # A contiguous tensor is its own stand-in: record each storage user once.
        for t in {id(t): t for t in used}.values():
            t.record_stream(self.stream)
        return CudaWork(self, self.nccl.record(), result)

    @staticmethod
    def _dense(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    def _copy_back(self, pairs) -> None:
        # Results computed into contiguous stand-ins go back into the caller's tensors, on
        # the group's stream, before the work's end event.
        pairs = [(t, b) for t, b in pairs if t is not b]
        if pairs:
            with torch.cuda.stream(self.stream):
                for t, b in pairs:
                    t.copy_(b)

    # -- collectives ------------------------------------------------------------------------
    def allreduce_one(self, t: torch.Tensor, op) -> CudaWork:
        """The latency path: one contiguous tensor, one crossing into the core."""
        if t.device != self.device or not t.is_contiguous() or self._p2p or t.is_sparse:
            return self.allreduce([t], op)
        ptr = t.data_ptr()
        # The argument check happens inside, in the same crossing (when checks are on).
        event = self.nccl.allreduce_after(current_stream(self.device), ptr, ptr, t.numel(), core_dtype(t), op,
                                          list(t.shape))
        t.record_stream(self.stream)
        return CudaWork(self, event, [t])

    def allreduce(self, tensors: List[torch.Tensor], op) -> CudaWork:
        self.check(tensors, "allreduce")
        self._verify(OpType.ALLREDUCE, tensors[0], "allreduce", op, shape=[sum(t.numel() for t in tensors)])
        bufs = [self._dense(t) for t in tensors]
        fuse = len(bufs) > 1 and len({b.dtype for b in bufs}) == 1
        if fuse:
            # Coalesced: one fusion buffer on the GPU, one NCCL call, then unpacked.
            flat = torch.cat([b.reshape(-1) for b in bufs])
            self.begin()
            self.nccl.allreduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), core_dtype(flat), op)
            with torch.cuda.stream(self.stream):
                torch._foreach_copy_([b.view(-1) for b in bufs], list(flat.split([b.numel() for b in bufs])))
            used = [flat, *bufs]
        else:
            self.begin()
            self.nccl.group_start()
            try:
                for b in bufs:
                    self.nccl.allreduce(b.data_ptr(), b.data_ptr(), b.numel(), core_dtype(b), op)
            finally:
                self.nccl.group_end()
            used = bufs
        self._copy_back(zip(tensors, bufs))
        return self.end([*tensors, *used], tensors)

    def broadcast(self, tensors: List[torch.Tensor], root: int) -> CudaWork:
        self.check(tensors, "broadcast")
        self._verify(OpType.BROADCAST, tensors[0], "broadcast", root=root, shape=[sum(t.numel() for t in tensors)])
        bufs = [self._dense(t) for t in tensors]
        self.begin()
        self.nccl.group_start()
        try:
            for b in bufs:
                self.nccl.broadcast(b.data_ptr(), b.data_ptr(), b.numel(), core_dtype(b), root)
        finally:
            self.nccl.group_end()
        self._copy_back(zip(tensors, bufs))
        return self.end([*tensors, *bufs], tensors)

    def reduce(self, tensors: List[torch.Tensor], op, root: int) -> CudaWork:
        self.check(tensors, "reduce")
        self._verify(OpType.REDUCE, tensors[0], "reduce", op, root)
        t = tensors[0]
        b = self._dense(t)
        self.begin()
        self.nccl.reduce(b.data_ptr(), b.data_ptr(), b.numel(), core_dtype(b), op, root)
        if self.rank == root:
            self._copy_back([(t, b)])
        return self.end([t, b], tensors)

    def allgather(self, outs: List[torch.Tensor], inp: torch.Tensor, result) -> CudaWork:
        self.check([inp, *outs], "all_gather")
        args.one_per_rank(outs, self.size, "all_gather", "output")
        args.same_dtype([inp, *outs], "all_gather")
        self._verify(OpType.ALLGATHER, inp, "all_gather", shape=[inp.numel(), len(outs)])
        src = self._dense(inp)
        if all(o.numel() == src.numel() for o in outs):
            flat = torch.empty(src.numel() * self.size, dtype=src.dtype, device=self.device)
            self.begin()
            self.nccl.allgather(src.data_ptr(), flat.data_ptr(), src.numel(), core_dtype(src))
            with torch.cuda.stream(self.stream):
                for o, part in zip(outs, flat.chunk(self.size)):
                    o.copy_(part.view(o.shape))
            return self.end([src, flat, *outs], result)
        # Uneven sizes: one broadcast from each rank, fused into a single NCCL launch.
        bufs = [src if r == self.rank else self._dense(o) for r, o in enumerate(outs)]
        self.begin()
        self.nccl.group_start()
        try:
            for r, b in enumerate(bufs):
                self.nccl.broadcast(b.data_ptr(), b.data_ptr(), b.numel(), core_dtype(b), r)
        finally:
            self.nccl.group_end()
        self._copy_back(zip(outs, bufs))
        return self.end([*bufs, *outs], result)

    def all_gather_into_tensor(self, pairs) -> CudaWork:
        """pairs: (output, input) tensors; several are coalesced into one NCCL launch."""
        for out, inp in pairs:
            self.check([out, inp], "all_gather_into_tensor")
            args.times_size(out, inp, self.size, "all_gather_into_tensor", "output")
        self._verify(OpType.ALLGATHER, pairs[0][1], "all_gather_into_tensor",
                     shape=[sum(i.numel() for _, i in pairs), len(pairs)])
        bufs = [(self._dense(o), self._dense(i)) for o, i in pairs]
        self.begin()
        self.nccl.group_start()
        try:
            for o, i in bufs:
                self.nccl.allgather(i.data_ptr(), o.data_ptr(), i.numel(), core_dtype(i))
        finally:
            self.nccl.group_end()
        self._copy_back((out, o) for (out, _), (o, _) in zip(pairs, bufs))
        return self.end([t for p in pairs for t in p] + [t for p in bufs for t in p], [o for o, _ in pairs])

    def reduce_scatter_tensor(self, pairs, op) -> CudaWork:
        """pairs: (output, input); the input holds size x output.numel() elements."""
        for out, inp in pairs:
            self.check([out, inp], "reduce_scatter_tensor")
            args.times_size(inp, out, self.size, "reduce_scatter_tensor", "input")
        self._verify(OpType.REDUCE_SCATTER, pairs[0][1], "reduce_scatter_tensor", op,
                     shape=[i.numel() for _, i in pairs])
        bufs = [(self._dense(o), self._dense(i)) for o, i in pairs]
        self.begin()
        self.nccl.group_start()
        try:
            for o, i in bufs:
                self.nccl.reduce_scatter(i.data_ptr(), o.data_ptr(), o.numel(), core_dtype(o), op)
        finally:
            self.nccl.group_end()
        self._copy_back((out, o) for (out, _), (o, _) in zip(pairs, bufs))
        return self.end([t for p in pairs for t in p] + [t for p in bufs for t in p], [o for o, _ in pairs])

    def reduce_scatter(self, out: torch.Tensor, ins: List[torch.Tensor], op, result) -> CudaWork:
        self.check([out, *ins], "reduce_scatter")
        args.one_per_rank(ins, self.size, "reduce_scatter", "input")
        args.same_dtype([out, *ins], "reduce_scatter")
        self._verify(OpType.REDUCE_SCATTER, out, "reduce_scatter", op, shape=[i.numel() for i in ins])
        flat = torch.cat([i.reshape(-1) for i in ins])
        if all(i.numel() == out.numel() for i in ins):
            return self._reduce_scatter_even(out, flat, op, result)
        # Uneven: rank r's part is a reduce to root r; one NCCL launch for all of them.
        b = self._dense(out)
        self.begin()
        self.nccl.group_start()
        try:
            offset = 0
            es = flat.element_size()
            for r, i in enumerate(ins):
                part = flat.data_ptr() + offset * es
                self.nccl.reduce(part, b.data_ptr() if r == self.rank else part, i.numel(), core_dtype(flat), op, r)
                offset += i.numel()
        finally:
            self.nccl.group_end()
        self._copy_back([(out, b)])
        return self.end([flat, b, out], result)

    def _reduce_scatter_even(self, out, flat, op, result) -> CudaWork:
        b = self._dense(out)
        self.begin()
        self.nccl.reduce_scatter(flat.data_ptr(), b.data_ptr(), b.numel(), core_dtype(b), op)
        self._copy_back([(out, b)])
        return self.end([flat, b, out], result)

    def _exchange(self, sends, recvs) -> None:
        """sends/recvs: per peer (pointer, elements, dtype) or None; one fused NCCL launch."""
        self.begin()
        self.nccl.group_start()
        try:
            for peer in range(self.size):
                if sends[peer] is not None:
                    self.nccl.send(*sends[peer], peer)
                if recvs[peer] is not None:
                    self.nccl.recv(*recvs[peer], peer)
        finally:
            self.nccl.group_end()

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits) -> CudaWork:
        self.check([out, inp], "all_to_all_single")
        P = self.size
        src, dst = self._dense(inp), self._dense(out)
        args.same_dtype([src, dst], "all_to_all_single")
        in_rows, out_rows = args.rows(src), args.rows(dst)
        in_splits = args.split_sizes(in_splits, in_rows, P, "all_to_all_single", "input")
        out_splits = args.split_sizes(out_splits, out_rows, P, "all_to_all_single", "output")
        row = args.row_numel(src)
        if row != args.row_numel(dst):
            raise ValueError(f"smddp all_to_all_single: rows of the input ({row} elements) and of the output "
                             f"({args.row_numel(dst)}) differ")
        self._verify(OpType.ALLTOALL, inp, "all_to_all_single")
        es, dt = src.element_size(), core_dtype(src)
        sends, recvs, so, ro = [], [], 0, 0
        for p in range(P):
            sends.append((src.data_ptr() + so * row * es, in_splits[p] * row, dt))
            recvs.append((dst.data_ptr() + ro * row * es, out_splits[p] * row, dt))
            so += in_splits[p]
            ro += out_splits[p]
        self._exchange(sends, recvs)
        self._copy_back([(out, dst)])
        return self.end([src, dst, inp, out], [out])

    def alltoall(self, outs: List[torch.Tensor], ins: List[torch.Tensor]) -> CudaWork:
        self.check([*outs, *ins], "all_to_all")
        args.one_per_rank(ins, self.size, "all_to_all", "input")
        args.one_per_rank(outs, self.size, "all_to_all", "output")
        args.same_dtype([*ins, *outs], "all_to_all")
        self._verify(OpType.ALLTOALL, ins[0], "all_to_all", shape=[len(ins), len(outs)])
        src = [self._dense(t) for t in ins]
        dst = [self._dense(t) for t in outs]
        self._exchange([(s.data_ptr(), s.numel(), core_dtype(s)) for s in src],
                       [(d.data_ptr(), d.numel(), core_dtype(d)) for d in dst])
        self._copy_back(zip(outs, dst))
        return self.end([*src, *dst, *outs], outs)

    def gather(self, outs: List[torch.Tensor], inp: torch.Tensor, root: int, result) -> CudaWork:
        self.check([inp, *outs], "gather")
        self._verify(OpType.BROADCAST, inp, "gather", root=root)
        src = self._dense(inp)
        sends = [None] * self.size
        recvs = [None] * self.size
        sends[root] = (src.data_ptr(), src.numel(), core_dtype(src))
        dst = []
        if self.rank == root:
            args.one_per_rank(outs, self.size, "gather", "output")
            args.each_numel(outs, inp.numel(), "gather", "output")
            args.same_dtype([inp, *outs], "gather")
            dst = [self._dense(o) for o in outs]
            recvs = [(d.data_ptr(), d.numel(), core_dtype(d)) for d in dst]
        self._exchange(sends, recvs)
        self._copy_back(zip(outs, dst))
        return self.end([src, *dst, *outs], result)

    def scatter(self, out: torch.Tensor, ins: List[torch.Tensor], root: int, result) -> CudaWork:
        self.check([out, *ins], "scatter")
        self._verify(OpType.BROADCAST, out, "scatter", root=root)
        dst = self._dense(out)
        sends = [None] * self.size
        recvs = [None] * self.size
        recvs[root] = (dst.data_ptr(), dst.numel(), core_dtype(dst))
        src = []
        if self.rank == root:
            args.one_per_rank(ins, self.size, "scatter", "input")
            args.each_numel(ins, out.numel(), "scatter", "input")
            args.same_dtype([out, *ins], "scatter")
            src = [self._dense(i) for i in ins]
            sends = [(s.data_ptr(), s.numel(), core_dtype(s)) for s in src]
        self._exchange(sends, recvs)
        self._copy_back([(out, dst)])
        return self.end([dst, out, *src], result)

    def _hold(self, is_send: bool, t: torch.Tensor, peer: int, what: str) -> CudaWork:
        self.check([t], what)
        if not 0 <= peer < self.size:
            raise ValueError(f"smddp {what}: peer rank {peer} is outside the group of {self.size}")
        work = CudaWork(self, None, [t])
        self._p2p.append((is_send, t, self._dense(t), peer, work))
        return work

    def send(self, t: torch.Tensor, peer: int) -> CudaWork:
        return self._hold(True, t, peer, "send")

    def recv(self, t: torch.Tensor, peer: int) -> CudaWork:
        return self._hold(False, t, peer, "recv")

    def flush_p2p(self) -> None:
        """Launches every held-back send and receive as one NCCL group."""
        ops, self._p2p = self._p2p, []
        if not ops:
            return
        self.nccl.wait_for(current_stream(self.device))
        self.nccl.group_start()
        try:
            for is_send, _, b, peer, _ in ops:
                (self.nccl.send if is_send else self.nccl.recv)(b.data_ptr(), b.numel(), core_dtype(b), peer)
        finally:
            self.nccl.group_end()
        self._copy_back((t, b) for is_send, t, b, _, _ in ops if not is_send)
        for _, t, b, _, _ in ops:
            t.record_stream(self.stream)
            b.record_stream(self.stream)
        event = self.nccl.record()
        for op in ops:
            op[4]._event = event

    def shutdown(self) -> None:
        self.nccl.shutdown()
