"""The process's handle on the native engine, for buffers that expose a data pointer.

Frontends (torch, TensorFlow) and tests call this module; it turns numpy arrays (or any
framework tensor viewed as one) into pointer + dtype + shape for the core, keeps the
arrays alive while the engine works on them, and hands back results. It holds no
collective logic of its own.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Optional, Sequence, Union

import numpy as np

from smdistributed import _core
from smdistributed.common.discovery import WorldInfo, discover
from smdistributed.common.inflight import Orphans

SmddpError = _core.SmddpError
DType = _core.DType
ReduceOp = _core.ReduceOp
OpType = _core.OpType

_NUMPY_TO_CORE = {
    np.dtype(np.float16): DType.float16,
    np.dtype(np.float32): DType.float32,
    np.dtype(np.float64): DType.float64,
    np.dtype(np.int8): DType.int8,
    np.dtype(np.uint8): DType.uint8,
    np.dtype(np.int32): DType.int32,
    np.dtype(np.int64): DType.int64,
    np.dtype(np.bool_): DType.bool,
}

_OP_NAMES = {
    "sum": ReduceOp.SUM,
    "average": ReduceOp.AVERAGE,
    "avg": ReduceOp.AVERAGE,
    "mean": ReduceOp.AVERAGE,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "product": ReduceOp.PRODUCT,
    "prod": ReduceOp.PRODUCT,
}

DTypeLike = Union[str, DType, np.dtype, None]


def core_dtype(array: np.ndarray, override: DTypeLike = None) -> DType:
    """The core dtype of `array`; `override` reinterprets its bytes (bfloat16 in uint16)."""
    if override is not None:
        if isinstance(override, DType):
            return override
        name = override if isinstance(override, str) else np.dtype(override).name
        try:
            dt = DType.__members__[name]
        except KeyError:
            raise TypeError(f"unsupported dtype {name!r}; supported: {', '.join(DType.__members__)}") from None
        if _core.dtype_size(dt) != array.dtype.itemsize:
            raise TypeError(f"cannot view {array.dtype} elements as {name}")
        return dt
    if array.dtype.name == "bfloat16":  # ml_dtypes / TF's numpy bfloat16
        return DType.bfloat16
    try:
        return _NUMPY_TO_CORE[array.dtype]
    except KeyError:
        raise TypeError(
            f"unsupported dtype {array.dtype}; supported: float16, bfloat16, float32, float64, "
            "int8, uint8, int32, int64, bool"
        ) from None


def reduce_op(op: Union[str, ReduceOp]) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return _OP_NAMES[str(op).lower()]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; use one of SUM, AVERAGE, MIN, MAX, PRODUCT") from None


def _contiguous(array: np.ndarray, what: str, written: bool = False) -> np.ndarray:
    """`array` itself (no copy), checked: the engine reads (and, if `written`, writes) its bytes."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (call np.ascontiguousarray first)")
    if written and not array.flags.writeable:
        raise ValueError(f"{what} is read-only (a read-only memmap or a view of immutable memory), but the result "
                         "is written there: pass a writable array, or out= a writable one")
    return array


class Work:
    """A queued operation. `wait()` blocks (GIL released) and returns the result."""

    def __init__(self, engine, handle: int, keep, finish=None, orphans: Optional[Orphans] = None):
        self._engine = engine
        self._handle = handle
        self._keep = keep  # arrays the engine reads or writes until completion
        self._finish = finish  # computes the result from the completed handle
        self._result = None
        self._done = False
        self._lock = threading.Lock()
        self._orphans = orphans

    def __del__(self):
        # Dropped before it finished: its arrays must outlive the engine's use of them.
        if not getattr(self, "_done", True) and self._orphans is not None:
            self._orphans.adopt([self._handle], self._keep)

    def is_completed(self) -> bool:
        return self._done or self._engine.poll(self._handle)

    def wait(self, timeout: Optional[float] = None):
        with self._lock:
            if self._done:
                return self._result
            keep = self._finish is not None  # results sized by negotiation are read first
            self._engine.wait(self._handle, -1.0 if timeout is None else timeout, keep)
            try:
                if keep:
                    self._result = self._finish(self._engine, self._handle)
            finally:
                if keep:
                    self._engine.release(self._handle)
            self._done = True
            self._keep = None
            return self._result


class Core:
    """One engine per process. Collective methods take numpy arrays."""

    def __init__(self, world: Optional[WorldInfo] = None, rendezvous=None, advertise_addr: str = "",
                 stall_timeout: float = -1.0):
        """`rendezvous`: an object with set(key, bytes) and get(key) -> bytes (a torch Store)
        to bootstrap through instead of our own store; `stall_timeout`: seconds a tensor may
        wait for ranks that have not submitted it (default SMDDP_TIMEOUT)."""
        self.world = world or discover()
        w = self.world
        self._engine = _core.Engine(
            rank=w.rank, size=w.size, local_rank=w.local_rank, local_size=w.local_size, host=w.host,
            store_addr=w.store_addr, store_port=w.store_port, secret=w.secret, rendezvous=rendezvous,
            advertise_addr=advertise_addr, stall_timeout=stall_timeout,
        )
        self._names = {}
        self._name_lock = threading.Lock()
        self._unnamed_thread = None  # the one thread whose unnamed calls are matched by order
        self._orphans = Orphans(self._engine)
        self._closed = False

    # ---- world -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def size(self) -> int:
        return self._engine.size

    @property
    def local_rank(self) -> int:
        return self._engine.local_rank

    @property
    def local_size(self) -> int:
        return self._engine.local_size

    @property
    def num_hosts(self) -> int:
        return self._engine.num_hosts

    @property
    def host_index(self) -> int:
        return self._engine.host_index

    def counters(self) -> dict:
        return self._engine.counters()

    def store_refused_connections(self) -> int:
        return self._engine.store_refused_connections()

    def bootstrap_refused_connections(self) -> int:
        """Connections this rank's listener for other hosts' ranks turned away at start-up."""
        return self._engine.bootstrap_refused_connections()

    @contextlib.contextmanager
    def batch(self):
        """Operations submitted inside reach the engine together: one announcement, and
        (once every rank's batch is in) fused transfers, like Horovod's grouped_allreduce."""
        self._engine.begin_batch()
        try:
            yield
        finally:
            self._engine.end_batch()

    def _auto_name(self, kind: str, name: Optional[str]) -> str:
        # Unnamed operations are matched across ranks by call order, like torch.distributed.
        # Calls from several threads interleave differently on every rank, so the k-th call
        # of one rank would meet another thread's k-th call of another: refuse that.
        if name is not None:
            return name
        me = threading.get_ident()
        with self._name_lock:
            if self._unnamed_thread is None:
                self._unnamed_thread = me
            elif self._unnamed_thread != me:
                raise RuntimeError(
                    f"unnamed {kind} from a second thread: operations without a name are matched across ranks "
                    "by the order of the calls, which threads make in a different order on every rank. Pass "
                    "name= (the same on every rank) to the collectives that other threads issue")
            n = self._names.get(kind, 0)
            self._names[kind] = n + 1
        return f"{kind}.{n}"

    def _submit(self, op, name, inp, out, dtype, *, shape=None, reduce=ReduceOp.SUM, root=0, splits=(),
                per_rank=(), prescale=1.0, postscale=1.0, async_op=False, finish=None, keep=()):
        self._orphans.sweep()
        handle = self._engine.submit(
            op=op, name=name, in_ptr=inp.ctypes.data, out_ptr=0 if out is None else out.ctypes.data,
            count=inp.size, out_capacity=0 if out is None else out.nbytes, dtype=dtype,
            shape=list(inp.shape if shape is None else shape), reduce_op=reduce, root=root, splits=list(splits),
            per_rank=list(per_rank), prescale=prescale, postscale=postscale,
        )
        work = Work(self._engine, handle, (inp, out) + tuple(keep), finish, self._orphans)
        if async_op:
            return work
        return work.wait()

    # ---- collectives -------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, op="sum", *, name=None, out=None, dtype: DTypeLike = None,
                  prescale=1.0, postscale=1.0, async_op=False):
        """Reduces across ranks into `out` (default: in place). Returns `out` (or a Work)."""
        array = _contiguous(array, "allreduce input", written=out is None)
        out = array if out is None else _contiguous(out, "allreduce output", written=True)
        if out.nbytes != array.nbytes:
            raise ValueError("allreduce output must have the input's size")
        dt = core_dtype(array, dtype)
        r = self._submit(OpType.ALLREDUCE, self._auto_name("allreduce", name), array, out, dt,
                         reduce=reduce_op(op), prescale=prescale, postscale=postscale, async_op=async_op)
        return r if async_op else out

    def broadcast(self, array: np.ndarray, root: int = 0, *, name=None, out=None, dtype: DTypeLike = None,
                  async_op=False):
        array = _contiguous(array, "broadcast buffer", written=out is None)
        out = array if out is None else _contiguous(out, "broadcast output", written=True)
        r = self._submit(OpType.BROADCAST, self._auto_name("broadcast", name), array, out, core_dtype(array, dtype),
                         root=root, async_op=async_op)
        return r if async_op else out

    def reduce(self, array: np.ndarray, root: int = 0, op="sum", *, name=None, out=None,
               dtype: DTypeLike = None, async_op=False):
        """Reduction to `root`; root's `out` (default: the input) receives it."""
        array = _contiguous(array, "reduce input", written=out is None and root == self.rank)
        out = array if out is None else _contiguous(out, "reduce output", written=root == self.rank)
        r = self._submit(OpType.REDUCE, self._auto_name("reduce", name), array, out, core_dtype(array, dtype),
                         reduce=reduce_op(op), root=root, async_op=async_op)
        return r if async_op else out

    def allgather(self, array: np.ndarray, *, name=None, out=None, dtype: DTypeLike = None, async_op=False):
        """Concatenates every rank's array along dim 0; the first dimension may differ per rank.

        Returns the gathered array (or a Work whose wait() does); with `out`, fills it.
        """
        array = _contiguous(array, "allgather input")
        shape = array.shape if array.ndim else (1,)
        dt = core_dtype(array, dtype)

        def finish(engine, handle):
            if out is not None:
                return out
            rows = engine.result_counts(handle)
            result = np.empty((sum(rows),) + tuple(shape[1:]), dtype=array.dtype)
            engine.copy_owned_output(handle, result.ctypes.data)
            return result

        if out is not None:
            _contiguous(out, "allgather output", written=True)
        return self._submit(OpType.ALLGATHER, self._auto_name("allgather", name), array, out, dt, shape=shape,
                            per_rank=[shape[0]], async_op=async_op, finish=finish)

    def reduce_scatter(self, array: np.ndarray, op="sum", *, name=None, counts: Optional[Sequence[int]] = None,
                       out=None, dtype: DTypeLike = None, async_op=False):
        """Reduces the flattened `array` and returns this rank's block (equal blocks, or `counts`)."""
        array = _contiguous(array, "reduce_scatter input")
        if counts is None:
            if array.size % self.size:
                raise ValueError(f"reduce_scatter input of {array.size} elements does not split evenly over "
                                 f"{self.size} ranks; pass counts=")
            counts = [array.size // self.size] * self.size
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != array.size:
            raise ValueError("reduce_scatter counts must give one block per rank and sum to the input size")
        out = (np.empty(counts[self.rank], dtype=array.dtype) if out is None
               else _contiguous(out, "reduce_scatter output", written=True))
        r = self._submit(OpType.REDUCE_SCATTER, self._auto_name("reduce_scatter", name), array, out,
                         core_dtype(array, dtype), reduce=reduce_op(op), splits=counts, async_op=async_op,
                         finish=lambda e, h: out)
        return r

    def alltoall(self, array: np.ndarray, splits: Optional[Sequence[int]] = None, *, name=None, out=None,
                 dtype: DTypeLike = None, async_op=False):
        """Sends rows splits[j] to rank j (equal split by default). Returns (received, recv_splits)."""
        array = _contiguous(array, "alltoall input")
        shape = array.shape if array.ndim else (1,)
        if splits is None:
            if shape[0] % self.size:
                raise ValueError(f"alltoall input's first dimension {shape[0]} does not split evenly over "
                                 f"{self.size} ranks; pass splits=")
            splits = [shape[0] // self.size] * self.size
        splits = [int(s) for s in splits]
        if len(splits) != self.size or sum(splits) != shape[0] or min(splits) < 0:
            raise ValueError("alltoall splits must give one non-negative row count per rank summing to dim 0")

        def finish(engine, handle):
            rows = list(engine.result_counts(handle))
            if out is not None:
                return out, rows
            result = np.empty((sum(rows),) + tuple(shape[1:]), dtype=array.dtype)
            engine.copy_owned_output(handle, result.ctypes.data)
            return result, rows

        if out is not None:
            _contiguous(out, "alltoall output", written=True)
        return self._submit(OpType.ALLTOALL, self._auto_name("alltoall", name), array, out,
                            core_dtype(array, dtype), shape=shape, per_rank=splits, async_op=async_op,
                            finish=finish)

    def barrier(self, *, name=None, async_op=False):
        dummy = np.zeros(0, dtype=np.uint8)
        return self._submit(OpType.BARRIER, self._auto_name("barrier", name), dummy, None, DType.uint8,
                            async_op=async_op)

    def send(self, array: np.ndarray, peer: int, tag: int = 0, async_op=False):
        array = _contiguous(array, "send buffer")
        self._orphans.sweep()
        work = Work(self._engine, self._engine.send(peer, tag, array.ctypes.data, array.nbytes), (array,),
                    orphans=self._orphans)
        return work if async_op else work.wait()

    def recv(self, array: np.ndarray, peer: int, tag: int = 0, async_op=False):
        array = _contiguous(array, "recv buffer", written=True)
        self._orphans.sweep()
        work = Work(self._engine, self._engine.recv(peer, tag, array.ctypes.data, array.nbytes), (array,),
                    orphans=self._orphans)
        if async_op:
            return work
        work.wait()
        return array

    def shutdown(self):
        if not self._closed:
            self._closed = True
            self._engine.shutdown()


_core_instance: Optional[Core] = None
_instance_lock = threading.Lock()


def init(world: Optional[WorldInfo] = None) -> Core:
    """Starts this process's engine (idempotent) and returns it."""
    global _core_instance
    with _instance_lock:
        if _core_instance is None:
            _core_instance = Core(world)
            atexit.register(_core_instance.shutdown)
        return _core_instance


def get() -> Core:
    if _core_instance is None:
        raise RuntimeError("smdistributed is not initialized: call init() first")
    return _core_instance


def is_initialized() -> bool:
    return _core_instance is not None


def shutdown():
    global _core_instance
    with _instance_lock:
        if _core_instance is not None:
            _core_instance.shutdown()
            _core_instance = None
