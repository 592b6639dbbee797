"""Messages between the pipeline ranks of one model replica, and how they travel.

A message is a kind, a few fields, and a body: any picklable structure in which tensors may
sit anywhere (args, kwargs, a model's dict or dataclass output). The body is pickled with
each tensor replaced by its index (pickle's persistent ids), so any container type travels
unchanged and the tensors go as raw data:

    header   4096 bytes, tag TAG_HEADER: meta length (8 bytes) + the meta if it fits; when the
             message's tensors are on the CPU and fit too, they follow the meta there and
             nothing else is sent (a flag in the length field says so)
    meta     the rest of the meta, tag TAG_META, when it did not fit
    tensors  one message each: CPU tensors on the pipeline group (tag TAG_PAYLOAD), CUDA
             tensors on the one-way group of this (sender, receiver) pair, through NCCL; where
             the two ranks share one GPU (NCCL refuses that), CUDA tensors as host copies on
             the pipeline group, made again on the receiver's GPU

The meta is (tensor specs, kind, fields, pickled body). A link carries messages one after
another: senders to one peer hold that peer's lock while they post and finish a message, and
one receiver thread per peer reads them in order, so the parts of two messages never
interleave (NCCL has no tags: a one-way group with one writer and one reader keeps its order).
"""
from __future__ import annotations

import collections
import io
import math
import pickle
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from . import cuda_streams

TAG_HEADER = 7101
TAG_META = 7102
TAG_PAYLOAD = 7103
HEADER_BYTES = 4096
_LEN = 8


class QuietLink(RuntimeError):
    """No message began on a link within the engine's timeout: the peer had nothing to say yet
    (a long step on its side), which is not a fault."""


@dataclass
class TensorSpec:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    on_cuda: bool
    requires_grad: bool


@dataclass
class Message:
    kind: str
    fields: Dict[str, Any] = field(default_factory=dict)  # small plain values, never tensors (see encode)
    body: Any = None  # anything picklable; its tensors travel as tensors


class _Pickler(pickle.Pickler):
    def __init__(self, buf, tensors: List[torch.Tensor]):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self._tensors.append(obj)
            return len(self._tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, tensors: List[torch.Tensor]):
        super().__init__(buf)
        self._tensors = tensors

    def persistent_load(self, pid):
        return self._tensors[pid]


def encode(msg: Message) -> Tuple[bytes, List[torch.Tensor], List[TensorSpec]]:
    """The meta bytes and the tensors of `msg`, in the order the receiver will rebuild them.
    The tensors are the caller's own (with their autograd history): only their data is sent.
    Only the body goes through the pickler that finds tensors (a Python call per object);
    the kind and fields hold none and are pickled with the meta."""
    tensors: List[torch.Tensor] = []
    body = None
    if msg.body is not None:
        buf = io.BytesIO()
        _Pickler(buf, tensors).dump(msg.body)
        body = buf.getvalue()
    specs = []
    for t in tensors:
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError("smp: only dense (strided) tensors can cross a partition boundary")
        specs.append(TensorSpec(tuple(t.shape), t.dtype, t.is_cuda, t.requires_grad))
    return pickle.dumps((specs, msg.kind, msg.fields, body), protocol=pickle.HIGHEST_PROTOCOL), tensors, specs


# Set in the header's length field when the message's tensors follow the meta inside the header.
_PACKED = 1 << 62


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's data as a flat uint8 view (any dtype: bool, bfloat16, complex)."""
    return t.reshape(-1).view(torch.uint8)


def header_for(meta: bytes, tensors: Optional[List[torch.Tensor]] = None) -> Tuple[torch.Tensor, int, bool]:
    """A message's header (the meta's length, then as much of the meta as fits), how many bytes
    of the meta it carries (the rest goes as TAG_META), and whether the message's `tensors`
    went in it too, after the meta (when all are on the CPU and fit): a small message is then
    one send instead of one per part, and its receiver wakes once (on CPU pipelines of small
    activations, the parts' sends and waits were most of a message's host time)."""
    size = sum(t.numel() * t.element_size() for t in tensors) if tensors else 0
    packed = bool(tensors) and len(meta) + size <= HEADER_BYTES - _LEN and not any(t.is_cuda for t in tensors)
    inline = min(len(meta), HEADER_BYTES - _LEN)
    raw = bytearray(HEADER_BYTES)  # zeroed; built in bytes and wrapped once (one tensor op, not four)
    raw[:_LEN] = (len(meta) | (_PACKED if packed else 0)).to_bytes(_LEN, "little")
    raw[_LEN:_LEN + inline] = meta[:inline]
    header = torch.frombuffer(raw, dtype=torch.uint8)
    if packed:
        at = _LEN + inline
        for t in tensors:
            n = t.numel() * t.element_size()
            header[at:at + n].copy_(_bytes_of(_as_sendable(t.detach().contiguous())))
            at += n
    return header, inline, packed


def _unpack(header: torch.Tensor, at: int, specs: List["TensorSpec"]) -> List[torch.Tensor]:
    """The tensors a packed header carries from byte `at` on, each a fresh CPU tensor (the
    header buffer is reused for the next message)."""
    tensors = []
    for s in specs:
        n = math.prod(s.shape) * s.dtype.itemsize  # checked before anything is allocated
        if min(s.shape, default=0) < 0 or at + n > HEADER_BYTES:
            raise RuntimeError(f"smp: a packed message header claims more tensor data than its {HEADER_BYTES} bytes")
        t = torch.empty(s.shape, dtype=s.dtype)
        _bytes_of(t).copy_(header[at:at + n])
        tensors.append(t)
        at += n
    return tensors


def _as_sendable(t: torch.Tensor) -> torch.Tensor:
    """What the process group moves for `t`: complex tensors as their real view, as
    torch.distributed's own send and recv do."""
    return torch.view_as_real(t) if t.is_complex() else t


def decode(kind: str, fields: Dict[str, Any], body: Optional[bytes], tensors: List[torch.Tensor]) -> Message:
    """The message whose meta (see encode) held `kind`, `fields` and `body`, its tensors received."""
    return Message(kind, fields, None if body is None else _Unpickler(io.BytesIO(body), tensors).load())


class Links:
    """Point-to-point message links between this rank and the other pipeline ranks."""

    def __init__(self, pp_group, pp_ranks: List[int], me: int, cuda_groups: Dict[Tuple[int, int], Any],
                 device: torch.device, host_staged: Optional[Set[Tuple[int, int]]] = None):
        self._group = pp_group
        self._ranks = pp_ranks  # global rank of each pipeline rank
        self._me = me
        self._cuda_groups = cuda_groups  # (src pp rank, dst pp rank) -> one-way group
        self._cuda_ranks: Dict[Tuple[int, int], int] = {}  # (src, dst) -> the peer's rank in that group
        self._host_staged = host_staged or set()  # (src, dst) on one GPU: CUDA tensors via host memory
        self._device = device
        self._locks = {p: threading.Lock() for p in range(len(pp_ranks)) if p != me}
        # Messages go through the process groups' own send and recv, with each peer's rank in
        # the group worked out once: torch.distributed's isend and recv translate the rank and
        # wrap the call at every message (about a third of a message's host time on CPUs).
        self._group_rank: Dict[int, int] = {}  # pipeline rank -> its rank in pp_group (see _rank_of)
        # The header buffer each peer's receiver thread (the only reader of that link) reuses.
        self._headers = {p: torch.empty(HEADER_BYTES, dtype=torch.uint8) for p in self._locks}
        # Sends that reserve a turn (Links.reserve) go out in the order of their reservations,
        # per peer and message kind: the peer queues each kind apart (forward calls, backward
        # requests), so a backward never waits for a forward's turn.
        self._turns = threading.Condition()
        self._next_ticket: Dict[Tuple[int, str], int] = collections.defaultdict(int)
        self._turn: Dict[Tuple[int, str], int] = collections.defaultdict(int)
        self.timeline = None  # set by the runtime: sends and receives appear in its trace
        self.aborted: Callable[[], Optional[BaseException]] = lambda: None  # set by the runtime
        # CUDA receives run on a stream of their own per peer: on the shared default stream an
        # NCCL receive would first wait for all compute queued before it, and the sender's
        # stream, waiting for the receive, would stall behind this rank's work (no pipelining).
        self._recv_streams = ({p: torch.cuda.Stream(device) for p in self._locks}
                              if device.type == "cuda" else {})
        # CUDA sends of a message made earlier (see made_at) start from a stream of their own
        # per peer, which waits only for the work that made the message.
        self._send_streams = ({p: torch.cuda.Stream(device) for p in self._locks}
                              if device.type == "cuda" else {})

    def made_at(self) -> Optional[Any]:
        """A point on this thread's current CUDA stream, taken while the sender still holds the
        compute token, right after the work that made a message's tensors (None off CUDA). The
        message's CUDA sends wait for that point only. The send itself is made later, without
        the token; waiting on the current stream then also waited for whatever other threads
        had queued meanwhile: on 2 x H200 the next microbatch's whole forward (2.6 ms) before
        each activation left stage 0, with stage 1 idle."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(cuda_streams.current(self._device.index))
        return event

    def reserve(self, dst: int, kind: str) -> int:
        """A turn for a later send to `dst`. The runtime reserves while holding the compute
        token, so sends leave in the order of the work that made them, not in whatever order
        their threads reach the link after letting go of the token: the peer serves calls in
        arrival order, and the order of microbatches through a module is visible (BatchNorm's
        running statistics, the sum of a parameter's gradients)."""
        with self._turns:
            ticket = self._next_ticket[dst, kind]
            self._next_ticket[dst, kind] += 1
            return ticket

    def send(self, dst: int, msg: Message, turn: Optional[int] = None,
             made_at: Optional[Any] = None) -> List[torch.Tensor]:
        """Sends `msg` to pipeline rank `dst`, after the sends of earlier turns when `turn` (from
        reserve) is given; returns the tensors it carried (the caller's). A turn is always
        used up, also when the send fails, so later turns never wait for it forever.
        `made_at`: see made_at (None: the tensors are final on the current stream now)."""
        with self._in_turn((dst, msg.kind), turn):
            meta, tensors, _ = encode(msg)
            with self.timeline.span(f"send {msg.kind} to {dst}", "send") if self.timeline else nullcontext():
                self.send_encoded(dst, meta, tensors, made_at)
            return tensors

    def send_encoded_in_turn(self, dst: int, kind: str, meta: bytes, tensors: List[torch.Tensor],
                             turn: Optional[int], made_at: Optional[Any] = None) -> None:
        """send_encoded of a message of `kind`, after the sends of earlier turns (see send)."""
        with self._in_turn((dst, kind), turn):
            self.send_encoded(dst, meta, tensors, made_at)

    def pass_turn(self, dst: int, kind: str, turn: int) -> None:
        """Gives up a reserved turn without sending (the work it was for failed)."""
        with self._in_turn((dst, kind), turn):
            pass

    @contextmanager
    def _in_turn(self, key, turn: Optional[int]):
        try:
            if turn is not None:
                with self._turns:
                    while not self._turns.wait_for(lambda: self._turn[key] == turn, timeout=0.5):
                        if (err := self.aborted()) is not None:
                            raise err  # an earlier turn may never come: the step is over
            yield
        finally:
            if turn is not None:
                with self._turns:
                    self._turn[key] += 1
                    self._turns.notify_all()

    def send_encoded(self, dst: int, meta: bytes, tensors: List[torch.Tensor],
                     made_at: Optional[Any] = None) -> None:
        header, inline, packed = header_for(meta, tensors)
        if packed:  # one send: the header carries the tensors
            with self._locks[dst]:
                self._group.send([header], self._rank_of(dst), TAG_HEADER).wait()
            return
        peer = self._ranks[dst]
        stream = None
        if made_at is not None and any(t.is_cuda for t in tensors):
            stream = self._send_streams[dst]
        to = self._rank_of(dst)
        staged = (self._me, dst) in self._host_staged
        with self._locks[dst]:
            works = [self._group.send([header], to, TAG_HEADER)]
            held = []  # contiguous copies must live until their sends finish
            if len(meta) > inline:
                rest = torch.frombuffer(bytearray(meta[inline:]), dtype=torch.uint8)
                works.append(self._group.send([rest], to, TAG_META))
            launched = []
            # The flush below makes NCCL wait for the current stream: the link's send stream,
            # when the message says where its tensors were made.
            with cuda_streams.running_on(stream) if stream is not None else nullcontext():
                if stream is not None:
                    stream.wait_event(made_at)
                for t in tensors:
                    if stream is not None and t.is_cuda:
                        t.record_stream(stream)  # read here (the copy below) after the caller may drop it
                    data = _as_sendable(t.detach().contiguous())
                    if data.is_cuda and staged:
                        data = data.cpu()  # waits for the work that made it (this stream waits for made_at)
                    held.append(data)
                    if data.is_cuda:
                        group, rank_there = self._cuda_group(self._me, dst, peer)
                        launched.append(group.send([data], rank_there, 0))
                    else:
                        works.append(self._group.send([data], to, TAG_PAYLOAD))
                for w in works:
                    w.wait()
                # A CUDA send is launched (is_completed flushes held-back point-to-point work)
                # but not waited on: the sender's stream goes on computing while NCCL reads the
                # data; the allocator keeps the memory until the send is done (record_stream).
                for w in launched:
                    w.is_completed()

    def receive(self, src: int) -> Tuple[Message, List[torch.Tensor], List[TensorSpec], Optional[Any]]:
        """The next message from pipeline rank `src` (only its receiver thread calls this), and
        a CUDA event that the consumer's stream must wait for before it uses the tensors."""
        peer = self._ranks[src]
        frm = self._rank_of(src)
        header = self._headers[src]
        try:
            self._group.recv([header], frm, TAG_HEADER).wait()
        except RuntimeError as e:
            if "made no progress" in str(e):
                raise QuietLink(str(e)) from e
            raise
        # From here on the link is inside a message: a receive that times out now is a fault
        # (the rest of the message is lost), not a quiet link.
        raw = header.numpy().tobytes()
        n = int.from_bytes(raw[:_LEN], "little")
        packed = bool(n & _PACKED)
        n &= ~_PACKED
        if n > (1 << 31) or (packed and n > HEADER_BYTES - _LEN):
            raise RuntimeError(f"smp: a message header from pipeline rank {src} claims {n} bytes of metadata")
        meta = raw[_LEN:_LEN + min(n, HEADER_BYTES - _LEN)]
        if n > len(meta):
            rest = torch.empty(n - len(meta), dtype=torch.uint8)
            self._group.recv([rest], frm, TAG_META).wait()
            meta += rest.numpy().tobytes()
        specs, kind, fields, body = pickle.loads(meta)
        if packed:
            tensors = _unpack(header, _LEN + n, specs)
            return decode(kind, fields, body, tensors), tensors, specs, None
        tensors = []
        ready = None
        staged = (src, self._me) in self._host_staged
        for s in specs:
            if s.on_cuda:
                if staged:  # a host copy on the pipeline group, made again on this GPU below
                    host = torch.empty(s.shape, dtype=s.dtype)
                    self._group.recv([_as_sendable(host)], frm, TAG_PAYLOAD).wait()
                stream = self._recv_streams[src]
                with cuda_streams.running_on(stream):
                    if staged:
                        t = host.to(self._device)
                    else:
                        t = torch.empty(s.shape, dtype=s.dtype, device=self._device)
                        group, rank_there = self._cuda_group(src, self._me, peer)
                        group.recv([_as_sendable(t)], rank_there, 0).wait()
                ready = torch.cuda.Event()
                ready.record(stream)
            else:
                t = torch.empty(s.shape, dtype=s.dtype)
                self._group.recv([_as_sendable(t)], frm, TAG_PAYLOAD).wait()
            tensors.append(t)
        return decode(kind, fields, body, tensors), tensors, specs, ready

    def _rank_of(self, p: int) -> int:
        """Pipeline rank `p`'s rank in the pipeline group (worked out at the first message)."""
        r = self._group_rank.get(p)
        if r is None:
            r = self._group_rank[p] = dist.get_group_rank(self._group, self._ranks[p])
        return r

    def _cuda_group(self, src: int, dst: int, peer: int):
        """The one-way group of (src, dst) and the rank in it of `peer` (a global rank)."""
        group = self._cuda_groups.get((src, dst))
        if group is None:
            raise RuntimeError("smp: a CUDA tensor crosses a partition boundary but CUDA links were not "
                               "made at smp.init (was CUDA unavailable then?)")
        rank_there = self._cuda_ranks.get((src, dst))
        if rank_there is None:
            rank_there = self._cuda_ranks[src, dst] = dist.get_group_rank(group, peer)
        return group, rank_there


def take(tensors: List[torch.Tensor], ready) -> None:
    """Makes received CUDA tensors safe to use on the calling thread's current stream."""
    if ready is None:
        return
    cuda = [t for t in tensors if t.is_cuda]
    if not cuda:  # the gradients' half of a merged answer can carry none (a frozen first stage, say)
        return
    stream = cuda_streams.current(cuda[0].get_device())
    stream.wait_event(ready)
    for t in cuda:
        t.record_stream(stream)
