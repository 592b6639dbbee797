"""ProcessGroupSMDDP: torch.distributed's process-group interface over the native engine.

Each group (the world, and every new_group()) owns one engine bootstrapped through the
group's c10d store, so sub-groups and groups of other backends coexist. Tensors go to the
engine as data pointers, without copies when they are contiguous. Collectives are matched
across ranks by a per-group sequence number, the order torch.distributed already requires.
"""
from __future__ import annotations

import functools
import itertools
import os
import secrets
import socket
import threading
from datetime import timedelta
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from smdistributed import _core
from smdistributed.common.discovery import WorldInfo
from smdistributed.common.engine import Core

from . import collective_args as args
from . import host_staging
from .cuda_collectives import CudaCollectives, ranks_sharing_gpus
from .tensors import contiguous, core_dtype, core_op, nbytes, on_cuda
from .work import CompletionThread, SmddpWork

OpType = _core.OpType
SUM = _core.ReduceOp.SUM


def _advertise_address() -> str:
    """The local address peers on other hosts can reach: the one that routes to MASTER_ADDR."""
    master = os.environ.get("MASTER_ADDR", "")
    if master in ("", "localhost") or master.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _group_secret(store, rank: int) -> str:
    # The launcher's secret when there is one; otherwise group rank 0 makes one and shares it
    # through the c10d store (which every rank of the group already trusts).
    if os.environ.get("SMDDP_SECRET"):
        return os.environ["SMDDP_SECRET"]
    if rank == 0:
        store.set("smddp/secret", secrets.token_hex(16))
    return store.get("smddp/secret").decode()


def _stall_timeout(timeout) -> float:
    """Seconds a collective may wait for ranks that have not submitted it; -1: SMDDP_TIMEOUT.

    torch passes its 30-minute default when the caller gave no timeout; a SMDDP_TIMEOUT the
    user set wins over that default (not over a timeout passed to init_process_group/new_group).
    """
    if not timeout:
        return -1.0
    if os.environ.get("SMDDP_TIMEOUT") and timeout == default_pg_timeout:
        return -1.0
    return timeout.total_seconds()


def _reduce_op(opts):
    return core_op(opts.reduceOp) if opts is not None else _core.ReduceOp.SUM


def _root(opts) -> int:
    return opts.rootRank if opts is not None else 0


def _staged_when_ranks_share_a_gpu(method):
    """A collective whose CUDA tensors go through host memory when the group's ranks share a
    GPU (host_staging.py); else the method as written (NCCL for CUDA tensors)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *a, **kw):
        if self._gpus_shared is not False:  # not known to have a GPU each (CPU-only groups scan their args)
            cuda = host_staging.cuda_tensors(a)
            if cuda and self._share_gpus(cuda[0].device):
                return host_staging.run(self, method, name, a, kw)
        return method(self, *a, **kw)

    return call


class WorldLayout(NamedTuple):
    local_rank: int
    local_size: int
    num_hosts: int
    host_index: int


class ProcessGroupSMDDP(dist.ProcessGroup):
    """The group's implementation. Under the native backend (native_backend.py) it is the
    Python half of the C++ c10d Backend: it owns the group's engine and NCCL communicator and
    runs the collectives the C++ fast paths hand it; without that backend it is the process
    group itself (torch's Python process-group path)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._timeout_s = _stall_timeout(timeout)
        self._core_obj = None  # made on first use: a group costs nothing until then
        self._core_lock = threading.Lock()
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._completion_thread = None
        self._cuda_collectives = None
        self._gpus_shared: Optional[bool] = None  # known at the first CUDA collective
        self._cuda_checks = os.environ.get("SMDDP_CUDA_CHECKS", "1") != "0"
        self._nccl_max_ctas: Optional[int] = None  # None: SMDDP_NCCL_MAX_CTAS, else NCCL's choice
        # Splits made so far per member set: counted per members, not per call, because a rank
        # outside a split is not asked by every torch version (so a count of all calls
        # differs between ranks), while every member of a group takes part in each of its splits.
        self._splits: Dict[Tuple[int, ...], int] = {}

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def _core(self) -> Core:
        """The group's CPU engine, bootstrapped through the group's store on first use (every
        rank of the group reaches it with the group's first collective)."""
        core = self._core_obj
        if core is not None:  # every call after the first: no lock on the submit path
            return core
        with self._core_lock:
            if self._core_obj is None:
                host = os.environ.get("SMDDP_HOST") or socket.gethostname()
                world = WorldInfo(rank=self.rank(), size=self.size(), local_rank=-1, local_size=-1, host=host,
                                  store_addr="", store_port=0, secret=_group_secret(self._store, self.rank()),
                                  launcher="torch")
                self._core_obj = Core(world, rendezvous=self._store, advertise_addr=_advertise_address(),
                                      stall_timeout=self._timeout_s)
            return self._core_obj

    @property
    def _engine(self):
        return self._core._engine

    @property
    def _orphans(self):
        return self._core._orphans  # buffers of Works dropped unfinished (common/inflight.py)

    @property
    def engine(self):
        """The group's native engine (for frontends that submit named operations to it)."""
        return self._engine

    def layout(self) -> "WorldLayout":
        """Where this rank sits: its local rank and size on its host, the hosts, its host."""
        c = self._core
        return WorldLayout(c.local_rank, c.local_size, c.num_hosts, c.host_index)

    # -- what the C++ Backend asks of its Python half --------------------------------------
    def _native_engine(self):
        return self._engine

    def _native_cuda(self, tensor: torch.Tensor):
        """(NcclGroup, stream id, device index, device type) of the group's communicator,
        made on `tensor`'s device if this is the group's first CUDA collective; None when the
        group's ranks share a GPU (the Backend then hands every CUDA call to this class)."""
        if self._share_gpus(tensor.device):
            return None
        gpu = self._cuda([tensor], "collective")
        s = gpu.stream
        return gpu.nccl, s.stream_id, s.device_index, s.device_type

    def _split(self, _torch_store, ranks, timeout_ms: int):
        """torch's split_group: the child group over `ranks` (ranks of this group), or None on a
        rank outside it. Its engine and communicator are made on first use, as for any group."""
        members = tuple(sorted(int(r) for r in ranks))
        if self.rank() not in members:
            return None
        n = self._splits.get(members, 0)
        self._splits[members] = n + 1
        # The child's keys live in this group's own store (which every member of the child
        # shares, whatever store torch hands each rank for the split), named by the child's
        # members and how many times they split before: each member computes the same name
        # whatever other groups it split, and sibling groups do not share keys (two
        # communicators bootstrapped from one key never start).
        prefix = f"smddp/split/{'-'.join(map(str, members))}/{n}/"
        child = ProcessGroupSMDDP(dist.PrefixStore(prefix, self._store), members.index(self.rank()),
                                  len(members), timedelta(milliseconds=timeout_ms))
        from . import native_backend

        return native_backend.load().BackendSMDDP(child, child.rank(), child.size(), int(timeout_ms))

    def getBackendName(self) -> str:
        return "smddp"

    def name(self) -> str:
        return "smddp"

    # torch keeps a group's name in the backends it registers on a ProcessGroup; this group is
    # its own backend (none registered), so C++'s getter would fail ("ProcessGroup name not
    # set"), breaking destroy_process_group(subgroup) and lookups by name.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _completions(self) -> CompletionThread:
        if self._completion_thread is None:
            self._completion_thread = CompletionThread(self._engine)
        return self._completion_thread

    def _share_gpus(self, device: torch.device) -> bool:
        """Whether ranks of this group share a GPU (asked of every rank at its first CUDA
        collective; then known): their CUDA collectives go through host memory."""
        if self._gpus_shared is None:
            sharing = ranks_sharing_gpus(self._store, "smddp/gpus", self.rank(), self.size(), device)
            self._gpus_shared = bool(sharing)
            if sharing:
                host_staging.warn_once(self.rank(), sharing)
        return self._gpus_shared

    def _cuda(self, tensors, what: str):
        """The group's NCCL side when the call's tensors are CUDA tensors, else None. The
        communicator is made on first use, on the device of that call's tensors."""
        if not on_cuda(tensors, what):
            return None
        if self._cuda_collectives is None:
            device = next(t.device for t in tensors if isinstance(t, torch.Tensor))
            self._cuda_collectives = CudaCollectives(self._store, self.rank(), self.size(), device,
                                                     self.gpu_timeout_s(), max_ctas=self._nccl_max_ctas)
            if self._cuda_checks:
                self._cuda_collectives.check_arguments_with(self._engine)
        return self._cuda_collectives

    def limit_nccl_ctas(self, max_ctas: int) -> None:
        """The most thread blocks (SMs) one NCCL operation of this group may occupy, for groups
        whose transfers wait on the GPU beside compute (a pipeline's links). Only before the
        group's first CUDA collective: the communicator is made with it. 0: SMDDP_NCCL_MAX_CTAS if
        set, else NCCL's choice."""
        if max_ctas < 0:
            raise ValueError(f"smddp: max_ctas must be 0 (NCCL's choice) or positive, got {max_ctas}")
        if self._cuda_collectives is not None:
            raise RuntimeError("smddp: limit_nccl_ctas must be called before the group's first CUDA collective")
        self._nccl_max_ctas = max_ctas or None

    def gpu_timeout_s(self) -> float:
        """How long a batch of NCCL work may run before the watchdog aborts it: the group's
        timeout, else SMDDP_TIMEOUT when set, else torch's default of 30 minutes."""
        if self._timeout_s > 0:
            return self._timeout_s
        return float(os.environ.get("SMDDP_TIMEOUT", default_pg_timeout.total_seconds()))

    def _name(self, kind: str) -> str:
        with self._seq_lock:
            return f"c10d.{next(self._seq)}.{kind}"

    def _submit(self, op, kind, inp: torch.Tensor, out, *, shape=None, reduce=SUM, root=0,
                splits=(), per_rank=(), name=None) -> int:
        self._orphans.sweep()
        for t in (inp, out):
            if t is not None and t.device.type != "cpu":  # the engine reads and writes host memory only
                raise RuntimeError(f"smddp {kind}: internal error: a buffer on {t.device} reached the CPU engine")
        return self._engine.submit(
            op=op, name=name or self._name(kind), in_ptr=inp.data_ptr(),
            out_ptr=0 if out is None else out.data_ptr(), count=inp.numel(),
            out_capacity=0 if out is None else nbytes(out), dtype=core_dtype(inp),
            shape=list(inp.shape) if shape is None else list(shape), reduce_op=reduce, root=root,
            splits=list(splits), per_rank=list(per_rank),
            by_order=name is None,  # c10d calls are matched by order: carry the calling thread
        )

    @staticmethod
    def _chain(*fns):
        fns = [f for f in fns if f is not None]
        return (lambda: [f() for f in fns]) if fns else None

    # -- collectives ------------------------------------------------------------------------
    @_staged_when_ranks_share_a_gpu
    def allreduce(self, tensors: List[torch.Tensor], opts=None):
        if len(tensors) == 1 and self._cuda_collectives is not None and tensors[0].is_cuda:
            return self._cuda_collectives.allreduce_one(tensors[0], _reduce_op(opts))
        if (gpu := self._cuda(tensors, "allreduce")) is not None:
            return gpu.allreduce(tensors, _reduce_op(opts))
        op = _reduce_op(opts)
        handles, backs = [], []
        for t in tensors:
            buf, back = contiguous(t, "allreduce")
            handles.append(self._submit(OpType.ALLREDUCE, "allreduce", buf, buf, reduce=op))
            backs.append(back)
        return SmddpWork(self, handles, tensors, self._chain(*backs))

    @_staged_when_ranks_share_a_gpu
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts=None):
        # Submitted together, so the engine fuses them into as few transfers as fit.
        return self.allreduce(tensors, opts)

    @_staged_when_ranks_share_a_gpu
    def broadcast(self, tensors: List[torch.Tensor], opts=None):
        if (gpu := self._cuda(tensors, "broadcast")) is not None:
            return gpu.broadcast(tensors, _root(opts))
        handles, backs = [], []
        for t in tensors:
            buf, back = contiguous(t, "broadcast")
            handles.append(self._submit(OpType.BROADCAST, "broadcast", buf, buf, root=_root(opts)))
            backs.append(back)
        return SmddpWork(self, handles, tensors, self._chain(*backs))

    @_staged_when_ranks_share_a_gpu
    def reduce(self, tensors: List[torch.Tensor], opts=None):
        if (gpu := self._cuda(tensors, "reduce")) is not None:
            return gpu.reduce(tensors, _reduce_op(opts), _root(opts))
        t = tensors[0]
        buf, back = contiguous(t, "reduce")
        h = self._submit(OpType.REDUCE, "reduce", buf, buf, reduce=_reduce_op(opts), root=_root(opts))
        return SmddpWork(self, [h], tensors, back if self.rank() == _root(opts) else None, keep=buf)

    def _allgather_flat(self, inp: torch.Tensor, out_flat: torch.Tensor, expected: List[int]):
        """(handle, the flat input the engine reads, which the Work must keep alive). `expected`:
        the elements this rank's output takes from each rank, checked against what they send
        (on every rank, before any data moves)."""
        flat_in = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().reshape(-1)
        return self._submit(OpType.ALLGATHER, "allgather", flat_in, out_flat, shape=[flat_in.numel()],
                            per_rank=[flat_in.numel(), *expected]), flat_in

    @_staged_when_ranks_share_a_gpu
    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                  opts=None):
        outs, inp = output_tensors[0], input_tensors[0]
        if (gpu := self._cuda([inp, *outs], "all_gather")) is not None:
            return gpu.allgather(outs, inp, output_tensors)
        contiguous(inp, "all_gather")
        for o in outs:
            contiguous(o, "all_gather output")
        args.one_per_rank(outs, self.size(), "all_gather", "output")
        args.same_dtype([inp, *outs], "all_gather")
        flat = torch.empty(sum(o.numel() for o in outs), dtype=inp.dtype, device="cpu")
        h, flat_in = self._allgather_flat(inp, flat, [o.numel() for o in outs])

        def scatter_back():
            offset = 0
            for o in outs:
                o.copy_(flat[offset:offset + o.numel()].view(o.shape))
                offset += o.numel()

        return SmddpWork(self, [h], output_tensors, scatter_back, keep=flat_in)

    @_staged_when_ranks_share_a_gpu
    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None):
        if (gpu := self._cuda([output, inp], "all_gather_into_tensor")) is not None:
            return gpu.all_gather_into_tensor([(output, inp)])
        out, back = contiguous(output, "all_gather_into_tensor output")
        contiguous(inp, "all_gather_into_tensor")
        args.times_size(out, inp, self.size(), "all_gather_into_tensor", "output")
        h, flat_in = self._allgather_flat(inp, out.view(-1), [inp.numel()] * self.size())
        return SmddpWork(self, [h], [output], back, keep=(flat_in, out))

    _allgather_base = all_gather_single

    def _coalesced(self, single, outputs, inputs, opts):
        # All submitted before any wait, so the engine can run them back to back; one Work.
        works = [single(o, i, opts) for o, i in zip(outputs, inputs)]
        return SmddpWork(self, [h for w in works for h in w._pending], outputs,
                         self._chain(*[w._finish for w in works]), keep=[w._keep for w in works])

    @_staged_when_ranks_share_a_gpu
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if (gpu := self._cuda([*outputs, *inputs], "all_gather_into_tensor_coalesced")) is not None:
            return gpu.all_gather_into_tensor(list(zip(outputs, inputs)))
        return self._coalesced(self.all_gather_single, outputs, inputs, opts)

    @_staged_when_ranks_share_a_gpu
    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts=None):
        out, ins = output_tensors[0], input_lists[0]
        if (gpu := self._cuda([out, *ins], "reduce_scatter")) is not None:
            return gpu.reduce_scatter(out, ins, _reduce_op(opts), output_tensors)
        args.one_per_rank(ins, self.size(), "reduce_scatter", "input")
        args.same_dtype([out, *ins], "reduce_scatter")
        flat = torch.cat([i.reshape(-1) for i in ins])
        counts = [i.numel() for i in ins]
        buf, back = contiguous(out, "reduce_scatter output")
        h = self._submit(OpType.REDUCE_SCATTER, "reduce_scatter", flat, buf, reduce=_reduce_op(opts),
                         splits=counts, shape=[flat.numel()])
        return SmddpWork(self, [h], output_tensors, self._chain(back, lambda: flat))

    @_staged_when_ranks_share_a_gpu
    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None):
        if (gpu := self._cuda([output, inp], "reduce_scatter_tensor")) is not None:
            return gpu.reduce_scatter_tensor([(output, inp)], _reduce_op(opts))
        out, back = contiguous(output, "reduce_scatter_tensor output")
        src, _ = contiguous(inp, "reduce_scatter_tensor")
        args.times_size(src, out, self.size(), "reduce_scatter_tensor", "input")
        h = self._submit(OpType.REDUCE_SCATTER, "reduce_scatter", src.view(-1), out, reduce=_reduce_op(opts),
                         splits=[out.numel()] * self.size(), shape=[src.numel()])
        return SmddpWork(self, [h], [output], back, keep=(src, out))

    _reduce_scatter_base = reduce_scatter_single

    @_staged_when_ranks_share_a_gpu
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if (gpu := self._cuda([*outputs, *inputs], "reduce_scatter_tensor_coalesced")) is not None:
            return gpu.reduce_scatter_tensor(list(zip(outputs, inputs)), _reduce_op(opts))
        return self._coalesced(self.reduce_scatter_single, outputs, inputs, opts)

    @_staged_when_ranks_share_a_gpu
    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes, input_split_sizes,
                          opts=None):
        P = self.size()
        if (gpu := self._cuda([output, inp], "all_to_all_single")) is not None:
            return gpu.all_to_all_single(output, inp, output_split_sizes, input_split_sizes)
        src, _ = contiguous(inp, "all_to_all_single")
        out, back = contiguous(output, "all_to_all_single output")
        args.same_dtype([src, out], "all_to_all_single")
        input_split_sizes = args.split_sizes(input_split_sizes, args.rows(src), P, "all_to_all_single", "input")
        output_split_sizes = args.split_sizes(output_split_sizes, args.rows(out), P, "all_to_all_single", "output")
        shape = list(src.shape) if src.dim() else [1]
        # The engine checks the input splits against the input, and (with every rank's
        # announcement) each rank's output splits against what the others send to it.
        h = self._submit(OpType.ALLTOALL, "all_to_all", src, out, shape=shape,
                         per_rank=[int(n) for n in input_split_sizes] + output_split_sizes)
        return SmddpWork(self, [h], [output], back, keep=(src, out))

    alltoall_base = all_to_all_single

    @_staged_when_ranks_share_a_gpu
    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                 opts=None):
        if (gpu := self._cuda([*output_tensors, *input_tensors], "all_to_all")) is not None:
            return gpu.alltoall(output_tensors, input_tensors)
        args.one_per_rank(input_tensors, self.size(), "all_to_all", "input")
        args.one_per_rank(output_tensors, self.size(), "all_to_all", "output")
        args.same_dtype([*input_tensors, *output_tensors], "all_to_all")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype, device="cpu")
        h = self._submit(OpType.ALLTOALL, "alltoall", flat_in, flat_out, shape=[flat_in.numel()],
                         per_rank=[t.numel() for t in input_tensors] + [t.numel() for t in output_tensors])

        def unpack():
            offset = 0
            for t in output_tensors:
                t.copy_(flat_out[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()

        return SmddpWork(self, [h], output_tensors, unpack, keep=flat_in)

    def barrier(self, opts=None):
        dummy = torch.empty(0, dtype=torch.uint8, device="cpu")
        return SmddpWork(self, [self._submit(OpType.BARRIER, "barrier", dummy, None)], [], keep=dummy)

    @_staged_when_ranks_share_a_gpu
    def gather(self, output_lists, input_tensors, opts=None):
        outs = output_lists[0] if output_lists else []
        if (gpu := self._cuda([*input_tensors, *outs], "gather")) is not None:
            return gpu.gather(outs, input_tensors[0], _root(opts), output_lists)
        # Through allgather: root keeps the parts (bandwidth P x what a tree gather would move).
        inp = input_tensors[0]
        if self.rank() == _root(opts):
            args.one_per_rank(outs, self.size(), "gather", "output")
            args.each_numel(outs, inp.numel(), "gather", "output")
            args.same_dtype([inp, *outs], "gather")
        flat = torch.empty(inp.numel() * self.size(), dtype=inp.dtype, device="cpu")
        h, flat_in = self._allgather_flat(inp, flat, [inp.numel()] * self.size())
        outs = output_lists[0] if self.rank() == _root(opts) else []

        def unpack():
            for r, o in enumerate(outs):
                o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(o.shape))

        return SmddpWork(self, [h], output_lists, unpack, keep=flat_in)

    @_staged_when_ranks_share_a_gpu
    def scatter(self, output_tensors, input_lists, opts=None):
        ins = input_lists[0] if input_lists else []
        if (gpu := self._cuda([*output_tensors, *ins], "scatter")) is not None:
            return gpu.scatter(output_tensors[0], ins, _root(opts), output_tensors)
        out = output_tensors[0]
        n = out.numel()
        if self.rank() == _root(opts):
            args.one_per_rank(ins, self.size(), "scatter", "input")
            args.each_numel(ins, n, "scatter", "input")
            args.same_dtype([out, *ins], "scatter")
        flat = (torch.cat([t.reshape(-1) for t in input_lists[0]]) if self.rank() == _root(opts)
                else torch.empty(n * self.size(), dtype=out.dtype, device="cpu"))
        h = self._submit(OpType.BROADCAST, "scatter", flat, flat, root=_root(opts))
        me = self.rank()
        return SmddpWork(self, [h], output_tensors, lambda: out.copy_(flat[me * n:(me + 1) * n].view(out.shape)))

    @_staged_when_ranks_share_a_gpu
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0):
        if (gpu := self._cuda(tensors, "send")) is not None:
            return gpu.send(tensors[0], dst)
        buf, _ = contiguous(tensors[0], "send")
        return SmddpWork(self, [self._engine.send(dst, tag, buf.data_ptr(), nbytes(buf))], tensors, keep=buf)

    @_staged_when_ranks_share_a_gpu
    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0):
        if (gpu := self._cuda(tensors, "recv")) is not None:
            return gpu.recv(tensors[0], src)
        buf, back = contiguous(tensors[0], "recv")
        return SmddpWork(self, [self._engine.recv(src, tag, buf.data_ptr(), nbytes(buf))], tensors, back)

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("smddp: recv without a source rank (recv_anysource) is not supported; pass src=")

    def shutdown(self):
        # The engine first: it fails what is still pending, and the completion thread hands
        # those failures to their futures before it stops.
        if self._cuda_collectives is not None:
            self._cuda_collectives.shutdown()
        if self._core_obj is not None:
            self._core_obj.shutdown()
        if self._completion_thread is not None:
            self._completion_thread.stop()

    def abort(self):
        self.shutdown()


def smddp_group(group=None) -> ProcessGroupSMDDP:
    """The smddp implementation behind a torch process group (default: the world), whether
    the group runs the native c10d Backend or the Python process group."""
    pg = group or dist.group.WORLD
    if pg is None or not dist.is_initialized():
        raise RuntimeError("call torch.distributed.init_process_group(backend=\"smddp\") first")
    if not isinstance(pg, dist.ProcessGroup):  # new_group's answer on a rank outside the group
        raise RuntimeError("this rank is not a member of the process group")
    if isinstance(pg, ProcessGroupSMDDP):
        return pg
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except Exception:
        backend = None
    impl = backend if isinstance(backend, ProcessGroupSMDDP) else getattr(backend, "impl", None)
    if not isinstance(impl, ProcessGroupSMDDP):
        raise RuntimeError(f"the process group is not of the smddp backend (it runs {pg.name()})")
    return impl
