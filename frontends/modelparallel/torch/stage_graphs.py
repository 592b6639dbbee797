"""CUDA graphs of a stage's local runs of Sequential children (SMDDP_SMP_CUDA_GRAPHS=1).

Why: a pipeline stage's microbatch is small, so its eager forward and backward are bound by
the host issuing kernels, not by the GPU running them. Measured on one H200 for 8 of the
pipeline benchmark's encoder layers (bench/results/stage_graph_probe_h200_2026-11-26.md):
13.5 ms a microbatch of 16 samples eagerly, 8.3 ms replayed as graphs. Replaying a captured
forward and backward costs the host two launches instead of hundreds.

What is graphed: a run of consecutive children of an nn.Sequential that this rank owns
entirely (every submodule local, none marked for activation checkpointing), called with
gradients on and one CUDA tensor in and one out. Everything else runs eagerly, as does any
run until its shape has run eagerly WARMUP_CALLS times (the eager runs are real microbatches,
and they make the libraries' lazy set-up happen outside a capture).

Instances. A replay of a captured forward overwrites the activations it saved for its
backward, so each microbatch in flight needs a graph pair of its own: an instance is leased
to the task that ran its forward (a microbatch on the root, a served call on other ranks) and
freed when that task's backward is done (a skip connection can run one backward node twice,
in two segments, so not at the first backward replay). There are at most as many instances
of one run as microbatches the schedule keeps in flight ("simple": all of them; "interleaved":
`active_microbatches`); a run that finds none free runs eagerly. Each instance's forward has a
memory pool of its own, held for the life of the model: the activations of one microbatch.
Every backward graph of the rank captures into one shared pool instead. A backward's
temporaries are dead once it ends, and its outputs (the input's and parameters' gradients) are
consumed right after its replay, on the same stream, before any other backward replays; so
the backwards can reuse each other's memory, and the rank reserves one backward's temporaries,
not one per instance. That needs the backward replays to run one after the other: they all
run on the device's default stream (the stream the compute threads use).

Gradients. The backward graph adds the parameters' gradients (one multi-tensor kernel) to
buffers of the run, shared by all its instances and shapes, which gather the whole step's
microbatches: zeroed before the step's first replay of the run, added to `.grad` once when
the rank's gradients are final (`flush`, before the data-parallel reduction reads them and
before the step returns). Before, the graph copied them into the buffers and two more
multi-tensor kernels added them to `.grad` after every replay, with a Python loop over the
parameters on the host each time. Replays and the flush hold one lock and run on one stream.
(Measured on 2 x H200, session 25: letting autograd add each gradient in place inside the
graph instead, as eager accumulation does, saved 0.1-0.27 GB reserved per stage, since the
backward pool no longer held a whole set of gradients at once, but its hundred small kernels
a replay made pp=2 at m = 8, 2 active, 7% slower.) A graph would skip hooks on a parameter's
gradient, so a run with one runs eagerly (run_view.py, checked by the runtime at each call).

Results equal the eager run's (the same kernels on the same data), up to the rounding of the
order in which microbatches' gradients are summed (the graphed ones first, then into `.grad`);
Python code inside the run that would decide differently from call to call (data-dependent
branches, a step counter) does not, which is why this is opt-in. Capture uses CUDA's
thread-local capture mode: the receiver threads go on issuing NCCL work while a stage captures.
A run that cannot be graphed for a reason known before capturing runs eagerly; a capture CUDA
refuses fails the step (CaptureFailed) rather than leave torch's CUDA state half in capture
mode under eager runs.
"""
from __future__ import annotations

import itertools
import logging
import random
import sys
import threading
from contextlib import contextmanager, nullcontext
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from . import cuda_streams
from .run_view import AttributeSnapshot, RunView
from .weight_split import NotSplittable, SplitPlan, check as check_split_backward, input_pass, post_order, weight_pass

WARMUP_CALLS = 2  # eager runs of a shape before its first capture
SHAPES_PER_RUN = 2  # graphed shapes of one run (a short last batch is one more); others run eagerly
MAX_ATTRIBUTE_RESTARTS = 3  # captures a run may start over for changed attributes before it stays eager
REPLAYS_THAT_FORGIVE = 20  # replays of a capture after which its run's count of restarts starts again

log = logging.getLogger("smdistributed.modelparallel")


class NotGraphable(Exception):
    """The run cannot be captured (its reason is the message); it runs eagerly from now on."""


class _Instance:
    """One captured forward/backward pair with its static inputs and outputs."""

    def __init__(self, modules: Sequence[nn.Module], x: torch.Tensor, stream: torch.cuda.Stream,
                 autocast_dtype: Optional[torch.dtype], backward_pool, param_grad_out: List[torch.Tensor],
                 accumulator: "_StepAccumulator", split_weights: bool = False):
        self.busy = False
        self.bwd_w: Optional[torch.cuda.CUDAGraph] = None  # the deferred weight pass (weight_split.py)
        self.not_split = ""  # why a backward asked to split was not
        run = nn.Sequential(*modules)  # a view of the children; owns nothing new
        named = _named_params_needing_grad(modules)
        if not named:
            raise NotGraphable("it has no parameters that need a gradient")
        self.params = [p for _, p in named]
        self.accumulator = accumulator
        # The capture runs on fresh leaves that share the parameters' memory. A parameter's own
        # gradient node was made by an eager run on the legacy default stream, and autograd
        # would make that stream wait on the capture (CUDA refuses: "operation would make the
        # legacy stream depend on a capturing blocking stream"); an alias's node is made here,
        # on the capture stream.
        aliases = {n: p.detach().requires_grad_() for n, p in named}
        pool = self.pool = torch.cuda.graph_pool_handle()  # its forward's own (see pool_labels)
        self.static_in = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.static_in.requires_grad_(x.requires_grad)
        stream.wait_stream(torch.cuda.current_stream())
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                split = split_weights and x.requires_grad
                self.not_split = _warm_run(run, aliases, x, autocast_dtype, check_split=split)
                with _Capture(self.fwd, pool, x.device.index), _autocast_without_cache(autocast_dtype):
                    with _on_aliases(run, aliases):
                        out = run(self.static_in)
                self.static_out = out.detach()
                self.static_grad_out = torch.empty_like(out)
                plan = None
                if split and not self.not_split:
                    try:
                        plan = SplitPlan(out, self.static_in, list(aliases.values()))
                    except NotSplittable as e:
                        self.not_split = str(e)
                # retain_graph: the saved activations stay allocated, so a second replay (a
                # skip connection runs a node's backward twice, in two segments) reads them
                # intact. The backward's temporaries go to the rank's shared backward pool.
                # The parameters' gradients are added, inside the graph, to the run's buffers
                # (one multi-tensor kernel); the graph's own are freed within the capture, so
                # the pool reuses them.
                if plan is None:
                    wrt = ([self.static_in] if x.requires_grad else []) + list(aliases.values())
                    with _Capture(self.bwd, backward_pool, x.device.index):
                        grads = torch.autograd.grad(out, wrt, self.static_grad_out, allow_unused=True,
                                                    retain_graph=True)
                        param_grads = list(grads[1:] if x.requires_grad else grads)
                        used = self._add_to(param_grad_out, param_grads)
                        self.static_grad_in = grads[0] if x.requires_grad else None
                        del grads, param_grads
                else:
                    # Two graphs in the shared backward pool, with no other backward replay
                    # between them on its stream (the accumulator runs a deferred weight pass
                    # before any other backward replay): the gradients the first keeps for the
                    # second stay allocated across both captures, so no other capture reuses
                    # their memory.
                    with _Capture(self.bwd, backward_pool, x.device.index):
                        self.static_grad_in, kept = input_pass(plan, out, self.static_in, self.static_grad_out)
                    self.bwd_w = torch.cuda.CUDAGraph()
                    with _Capture(self.bwd_w, backward_pool, x.device.index):
                        param_grads = weight_pass(plan, kept, list(aliases.values()))
                        used = self._add_to(param_grad_out, param_grads)
                        del param_grads, kept
                    del plan
                del out
        finally:  # the warm run read `x` there, and the caller's stream goes on with it
            torch.cuda.current_stream().wait_stream(stream)
        self.static_in = self.static_in.detach()  # a plain buffer from now on, in no autograd graph
        self.param_grad_out = param_grad_out  # the run's shared set (layout() counts the sets)
        self.used = used  # the parameters whose gradients the graph adds to param_grad_out
        self.used_set = frozenset(used)

    @staticmethod
    def _add_to(buffers: List[torch.Tensor], param_grads: List[Optional[torch.Tensor]]) -> List[int]:
        """Inside a capture: adds the parameters' gradients to the run's buffers (one
        multi-tensor kernel); returns the indices of those that got one."""
        used = [i for i, g in enumerate(param_grads) if g is not None]
        if used:
            torch._foreach_add_([buffers[i] for i in used], [param_grads[i] for i in used])
        return used


def _named_params_needing_grad(modules: Sequence[nn.Module]):
    """The run's parameters in the order its graphs take them, each once (a tied one too)."""
    return [(n, p) for n, p in nn.Sequential(*modules).named_parameters() if p.requires_grad]


class _GradBuffers:
    """The buffers that a run's backward graphs add its parameters' gradients to: one set per
    run, shared by all its instances and shapes, gathering the step's microbatches. Sharing is
    safe because every backward replays on one stream under one lock, and the sum goes to
    `.grad` once the rank's backward work is done (see the module's doc). It saves the size of
    the run's parameters for each instance beyond the first."""

    def __init__(self):
        self._sets: Dict[tuple, tuple] = {}  # run id -> (the parameters it was made for, buffers)

    def get(self, run_id: tuple, params: Sequence[nn.Parameter]) -> List[torch.Tensor]:
        made_for = tuple((id(p), tuple(p.shape), p.dtype, p.device) for p in params)
        if run_id not in self._sets or self._sets[run_id][0] != made_for:
            # Instances made for replaced parameters keep their old set alive while they exist.
            self._sets[run_id] = (made_for, [torch.empty_like(p, memory_format=torch.contiguous_format)
                                             for p in params])
        return self._sets[run_id][1]

    def clear(self) -> None:
        self._sets.clear()


class _StepAccumulator:
    """Which runs' gradient buffers hold gradients of the current step not yet in `.grad`;
    `lock` orders every backward replay and the flush (see the module's doc)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._pending: Dict[int, tuple] = {}  # id(buffers) -> (params, buffers, used indices)
        # Instances whose input pass replayed and whose weight pass has not (weight_split.py).
        # Their kept gradients are in the shared backward pool, so each weight pass replays
        # before any other backward replay, the flush, and the instance's release (after which
        # another microbatch's forward would overwrite the activations it reads).
        self.deferred: List["_Instance"] = []

    def run_deferred(self) -> None:
        with self.lock:
            self.run_deferred_locked()

    def run_deferred_locked(self) -> None:
        """The deferred weight passes, in the order of their input passes, on the stream where
        every backward replays (the device's default one)."""
        if not self.deferred:
            return
        device = self.deferred[0].static_in.device.index
        shared = torch.cuda.default_stream(device)
        with cuda_streams.running_on(shared) if cuda_streams.current(device) != shared else nullcontext():
            for inst in self.deferred:
                inst.bwd_w.replay()
        self.deferred.clear()

    def begin(self, inst: "_Instance") -> None:
        """Before a backward replay (lock held): the run's first replay this step zeroes its buffers."""
        key = id(inst.param_grad_out)
        entry = self._pending.get(key)
        if entry is None:
            if inst.used:
                torch._foreach_zero_([inst.param_grad_out[i] for i in inst.used])
            self._pending[key] = (inst.params, inst.param_grad_out, set(inst.used_set))
        elif not inst.used_set <= entry[2]:  # another shape of the run reached other parameters
            fresh = [i for i in inst.used if i not in entry[2]]
            torch._foreach_zero_([inst.param_grad_out[i] for i in fresh])
            entry[2].update(fresh)

    def flush(self) -> None:
        """Adds the buffered gradients to `.grad` (a new `.grad` where there is none), on the
        stream where the replays ran. Forgotten only once their kernels are launched: a flush
        that raises (out of memory, say) fails the step and leaves them to discard()."""
        with self.lock:
            self.run_deferred_locked()
            pending = list(self._pending.values())
            if not pending:
                return
            device = pending[0][1][0].device
            with torch.cuda.stream(torch.cuda.default_stream(device)) if device.type == "cuda" else nullcontext():
                adds, add_src, fresh, fresh_src = [], [], [], []
                for params, buffers, used in pending:
                    for i in sorted(used):
                        p, g = params[i], buffers[i]
                        if p.grad is None:
                            p.grad = torch.empty_like(p, memory_format=torch.preserve_format)
                            fresh.append(p.grad)
                            fresh_src.append(g)
                        elif p.grad.dtype == g.dtype and p.grad.shape == g.shape:
                            adds.append(p.grad)
                            add_src.append(g)
                        else:
                            p.grad.add_(g)
                if fresh:
                    torch._foreach_copy_(fresh, fresh_src)
                if adds:
                    torch._foreach_add_(adds, add_src)
            self._pending = {}

    def discard(self) -> None:
        with self.lock:
            self._pending = {}
            self.deferred.clear()


class CaptureFailed(RuntimeError):
    """CUDA refused a capture. Raised, not fallen back from: a failed capture can leave torch's
    CUDA state half in capture mode (its RNG's graph offsets), which eager runs would then
    use; the step fails on every rank, naming the run, instead."""


class _Capture:
    def __init__(self, graph: torch.cuda.CUDAGraph, pool, device: int):
        self.graph, self.pool, self.device = graph, pool, device

    def __enter__(self):
        try:
            self.graph.capture_begin(self.pool, capture_error_mode="thread_local")
        except RuntimeError as e:
            self._stop_routing()
            raise CaptureFailed(f"starting a capture failed: {e}") from e

    def __exit__(self, exc_type, exc, tb):
        try:
            self.graph.capture_end()  # raises when the capture was invalidated
        except RuntimeError as e:
            # torch checks cudaStreamEndCapture before it stops routing this thread's
            # allocations to the graph's pool; left routed, the allocator would stop
            # reclaiming freed blocks for good.
            self._stop_routing()
            if exc_type is None:
                raise CaptureFailed(f"ending the capture failed: {e}") from e
        if exc_type is not None and not issubclass(exc_type, NotGraphable):
            # The error inside the capture is the one to report, not the invalidated capture's.
            raise CaptureFailed(f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        return False

    def _stop_routing(self) -> None:
        # The name changed across torch releases (torch.cuda.use_mem_pool calls it).
        stop = (getattr(torch._C, "_cuda_endAllocateToPool", None)
                or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None))
        try:
            stop(self.device, self.pool)
        except (RuntimeError, TypeError):
            pass  # already stopped (the capture ended) or never started


def _autocast_without_cache(dtype: Optional[torch.dtype]):
    # Autocast's cache of cast weights would hold tensors of the graph's pool past the capture.
    return torch.autocast("cuda", dtype=dtype, cache_enabled=False, enabled=dtype is not None)


@contextmanager
def _on_aliases(run: nn.Module, aliases: Dict[str, torch.Tensor]):
    """Runs `run` with each parameter that has an alias (by name, as
    _named_params_needing_grad names them) replaced by it, everywhere the parameter is
    registered, and puts the very same Parameter objects back after. (torch.func.functional_call
    did this until session 35, but with a module listed twice in the run, the same Linear
    called at two places, it saved the second name's "original" after swapping the first, and
    left the alias registered: the module then trained a detached tensor, not its parameter.)"""
    named = dict(run.named_parameters())
    alias_of = {id(named[n]): a for n, a in aliases.items()}
    swapped = []
    for module in run.modules():  # each module once, however often the run lists it
        for name, p in module._parameters.items():
            if p is not None and id(p) in alias_of:
                swapped.append((module, name, p))
    try:
        for module, name, p in swapped:
            module._parameters[name] = alias_of[id(p)]
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def _warm_run(run: nn.Module, aliases, x: torch.Tensor, autocast_dtype: Optional[torch.dtype],
              check_split: bool = False) -> str:
    """One uncaptured forward and backward in this thread on the capture stream, just before
    the capture. cuBLAS and cuDNN make their handles, workspaces and attention plans per
    thread (and per stream) at first use, with allocations that CUDA refuses inside a capture
    (measured: cuDNN's "DEVICE_ALLOCATION_FAILED" when another thread had run the eager
    microbatches). Its effects are undone (_ForwardEffects; the random generators), and its
    gradients go nowhere (autograd.grad, not .grad). With `check_split`, its backward is the
    split one checked against one backward (weight_split.check); returns why the split cannot
    be used ("" when it can, or was not asked for)."""
    effects = _ForwardEffects(run)
    rng = torch.cuda.get_rng_state(x.device)
    host_rngs = _host_rng_states()
    try:
        why_not_split = _warm_body(run, aliases, x, autocast_dtype, check_split, host_rngs)
    finally:
        problem = effects.undo()
        torch.cuda.set_rng_state(rng, x.device)
        _set_host_rng_states(host_rngs)
    if problem:
        raise NotGraphable(problem)
    return why_not_split


def _warm_body(run, aliases, x, autocast_dtype, check_split: bool, host_rngs) -> str:
    """The warm run itself: its forward, the checks that need a forward, and its backward."""
    probe = x.detach().clone().requires_grad_(x.requires_grad)
    with _autocast_without_cache(autocast_dtype):
        with _on_aliases(run, aliases):
            out = run(probe)
    if not isinstance(out, torch.Tensor) or not out.is_cuda or not out.requires_grad:
        raise NotGraphable("its output is not one CUDA tensor that needs a gradient")
    drawn = [name for name, state in _host_rng_states().items() if not _same_state(state, host_rngs[name])]
    if drawn:
        # A decision on the host (LayerDrop's `if torch.rand([]) < p`) would be replayed
        # as it fell at the capture, every time.
        raise NotGraphable(f"its forward draws from the host's random numbers ({', '.join(drawn)}): "
                           "a graph would replay one draw")
    strays = _stray_leaves(out, list(aliases.values()) + [probe])
    if strays:
        raise NotGraphable(f"it uses {len(strays)} tensor(s) that need a gradient but are not parameters "
                           "registered in its modules (kept in a list, say): its graph would give them none")
    if check_split:
        try:
            check_split_backward(out, probe, list(aliases.values()), torch.randn_like(out))
        except NotSplittable as e:
            return str(e)
        return ""
    wrt = ([probe] if x.requires_grad else []) + list(aliases.values())
    torch.autograd.grad(out, wrt, torch.zeros_like(out), allow_unused=True)
    return ""


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version, and nothing changes it outside inference mode
        return None


class _ForwardEffects:
    """What a forward may change, taken before the warm run and undone after it, so that the
    microbatch that triggers a capture changes it once (in its replay), as an eager run does:
    buffers (BatchNorm's statistics), tensors kept as plain attributes (put back if replaced,
    their values restored), and parameters that need no gradient.

    The values are written back through `.data`, which does not bump the tensors' versions:
    the eager backwards still pending (the earlier microbatches of a "simple" step) saved some
    of these (a cache a product reads, BatchNorm's running statistics in cuDNN's backward) and
    would refuse to run after a versioned copy. (Versions cannot tell what the forward wrote
    either: cuDNN's batch norm updates its running statistics without bumping them.) Frozen
    parameters are not copied beforehand (a frozen base model can be most of a stage): one
    whose version the forward bumped makes the run ineligible instead."""

    def __init__(self, run: nn.Module):
        self.attributes = [(vars(m), name, v) for m in run.modules() for name, v in vars(m).items()
                           if isinstance(v, torch.Tensor)]
        seen, self.copies = set(), []
        for t in itertools.chain(run.buffers(), (v for _, _, v in self.attributes)):
            if id(t) not in seen and _version(t) is not None:
                seen.add(id(t))
                self.copies.append((t, t.detach().clone()))
        self.frozen = [(p, _version(p)) for p in run.parameters() if not p.requires_grad]

    def undo(self) -> str:
        """Undoes the changes; returns why the run cannot be graphed ("" if it can)."""
        problems = []
        with torch.no_grad():
            for d, name, t in self.attributes:
                if d.get(name) is not t:
                    d[name] = t
            for t, copy in self.copies:
                try:
                    t.data.copy_(copy)
                except RuntimeError as e:
                    problems.append(f"a tensor its forward may change could not be restored ({e})")
        if any(_version(p) != version for p, version in self.frozen):
            problems.append("its forward changes a parameter that needs no gradient in place (a graph's "
                            "capture would apply that change once more)")
        return "; ".join(problems)


def _host_rng_states() -> Dict[str, object]:
    """The random generators a forward may draw from on the host: torch's CPU one, Python's,
    and numpy's when it is loaded."""
    states = {"torch's CPU generator": torch.get_rng_state(), "Python's random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy.random"] = numpy.random.get_state()
    return states


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) > 1 and hasattr(a[1], "shape"):  # numpy's (name, keys, pos, ...)
        return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]
    return a == b


def _set_host_rng_states(states: Dict[str, object]) -> None:
    torch.set_rng_state(states["torch's CPU generator"])
    random.setstate(states["Python's random"])
    if "numpy.random" in states:
        sys.modules["numpy"].random.set_state(states["numpy.random"])


def _stray_leaves(out: torch.Tensor, known: Sequence[torch.Tensor]) -> list:
    """The leaves `out` needs a gradient for besides `known` (the aliases and the input): a
    parameter the run reaches without it being registered in its modules."""
    ids = set(map(id, known))
    nodes = post_order(out.grad_fn) if out.grad_fn is not None else []
    return [n.variable for n in nodes if hasattr(n, "variable") and id(n.variable) not in ids]


class _GraphedRun(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inst: _Instance, x: torch.Tensor, _grad_anchor: nn.Parameter):
        if inst.bwd_w is not None:
            # Its last weight pass ran on the default stream after this caller's stream last
            # waited for it (a backward under another stream): the replay overwrites what it read.
            device = x.device.index
            caller, shared = cuda_streams.current(device), torch.cuda.default_stream(device)
            if caller != shared:
                caller.wait_stream(shared)
        inst.static_in.copy_(x)
        inst.fwd.replay()
        ctx.inst = inst
        # A copy: the next replay of this instance overwrites static_out, and the caller may
        # keep its output longer (a send in flight, the step's returned outputs).
        return inst.static_out.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        inst = ctx.inst
        # The backward graphs share one pool, so their replays and the reads of their outputs
        # must follow each other on one stream: the default stream, where the compute threads
        # run (a forward run under another stream would bring its backward there).
        device = grad_out.get_device()
        caller, shared = cuda_streams.current(device), torch.cuda.default_stream(device)
        elsewhere = caller != shared
        if elsewhere:
            shared.wait_stream(caller)
        with inst.accumulator.lock, cuda_streams.running_on(shared) if elsewhere else nullcontext():
            inst.accumulator.run_deferred_locked()  # (they read the shared pool this replay reuses)
            inst.accumulator.begin(inst)
            inst.static_grad_out.copy_(grad_out)
            inst.bwd.replay()
            grad_in = inst.static_grad_in.clone() if inst.static_grad_in is not None else None
            if inst.bwd_w is not None:
                # Its weight pass waits until the caller has taken the input gradients' point
                # for the message that carries them (StageGraphs.run_deferred_weights).
                inst.accumulator.deferred.append(inst)
        if elsewhere:
            caller.wait_stream(shared)
            if grad_in is not None:  # made on the default stream, used on the caller's
                grad_in.record_stream(caller)
        return None, grad_in, None


class _Entry:
    def __init__(self):
        self.instances: List[_Instance] = []
        self.eager_calls = 0
        self.fingerprint: tuple = ()
        self.attributes: Optional[AttributeSnapshot] = None  # the submodules' plain attributes at its capture
        self.replays = 0  # leases of its instances since it last started over


class StageGraphs:
    """The graphed runs of one rank's stage; the runtime sets `limit` at each step."""

    def __init__(self, enabled: bool, split_weights: bool = False):
        self.enabled = enabled and torch.cuda.is_available()
        # Runs whose input needs a gradient capture their backward as two passes, the weights'
        # deferred (weight_split.py; SMDDP_SMP_DEFER_WEIGHT_GRADS).
        self.split_weights = split_weights
        self.limit = 1
        self.counters = {"replays": 0, "captures": 0, "eager": 0, "no_free_instance": 0, "split_captures": 0}
        self._lock = threading.Lock()
        self._entries: Dict[tuple, _Entry] = {}
        self._refused: Dict[tuple, str] = {}  # run -> why it cannot be graphed
        self._views: Dict[tuple, RunView] = {}  # run -> its modules, as the checks read them
        self._stream: Optional[torch.cuda.Stream] = None
        self._backward_pool = None  # every backward graph's temporaries (see the module's doc)
        self._grad_buffers = _GradBuffers()
        self._accumulator = _StepAccumulator()  # the step's graphed gradients, and the replays' lock
        self._captures_seen = 0  # captures when the cache was last given back (after_step)
        self._tls = threading.local()
        self._not_split: set = set()  # runs whose backward could not be split (logged once)
        self._attribute_restarts: Dict[tuple, int] = {}  # run -> captures dropped for changed attributes

    def inside_capture(self) -> bool:
        """True in the thread that is warming or capturing a run: a Sequential nested in it
        (its forward patched like every Sequential's) must run plainly, neither graphed nor
        stepping aside for other work (another task would compute into the capture)."""
        return getattr(self._tls, "depth", 0) > 0

    def run(self, run_id: tuple, modules: Sequence[nn.Module], x, leases: List[_Instance], eager):
        """The output of `modules` applied in turn to `x`: replayed when it can be, else
        `eager()`. A leased instance is appended to `leases` (freed by `release`)."""
        key = self._key(run_id, modules, x)
        if key is None:
            self.counters["eager"] += 1
            return eager()
        inst = self._lease(key, modules, x)
        if inst is None:
            self.counters["eager"] += 1
            return eager()
        leases.append(inst)
        self.counters["replays"] += 1
        # One of the run's parameters goes in as an input only so that the output needs a
        # gradient when `x` does not (the first stage); its gradient comes through
        # the run's buffers with the others.
        return _GraphedRun.apply(inst, x, inst.params[0])

    def weights_deferred(self) -> bool:
        """Whether a weight pass waits (run_deferred_weights): the caller takes its point for
        the input gradients' message first."""
        return bool(self._accumulator.deferred)

    def run_deferred_weights(self) -> None:
        """Replays the weight passes deferred by this rank's input passes. The runtime calls it
        right after taking the CUDA point its message of input gradients is sent from, so the
        send waits for the input passes only, and the weight passes compute while it crosses."""
        self._accumulator.run_deferred()

    def release(self, leases: List[_Instance]) -> None:
        if any(inst.bwd_w is not None for inst in leases):
            self._accumulator.run_deferred()  # (the next lease's forward overwrites what they read)
        with self._lock:
            for inst in leases:
                inst.busy = False
        leases.clear()

    def flush_gradients(self) -> None:
        """Adds the graphed runs' gradients of this step to `.grad`: called once this rank's
        backward work of the step is done, before anything reads `.grad`."""
        self._accumulator.flush()

    def discard_gradients(self) -> None:
        """Forgets the gradients of a step that failed (the next step zeroes the buffers)."""
        self._accumulator.discard()

    def clear(self) -> None:
        """Drops every captured instance and its memory (between steps only)."""
        self._accumulator.flush()
        with self._lock:
            self._entries.clear()
            self._refused.clear()
            self._views.clear()
            self._backward_pool = None
            self._grad_buffers.clear()

    def captured(self) -> bool:
        """Whether any captured instance exists."""
        with self._lock:
            return any(entry.instances for entry in self._entries.values())

    def after_step(self) -> None:
        """Called when a step has ended on this rank (every message of it received): after a
        step that captured, the allocator's unused cache goes back to the device. The eager
        warm-up runs left it as large as an eager step needs, and each capture's warm run (on
        the capture stream, whose cached blocks no other stream reuses) as large again, while
        graphed runs take their memory from the graphs' pools (measured on 2 x H200, pp=2,
        m = 4, 2 active: 4.25 GB reserved on the first stage in steady steps, 3.27 GB with
        the cache given back). Not during the step: emptying the cache waits for this rank's
        sends in flight while holding the allocator, which the peer's receiver may need
        before it can post the matching receive."""
        if self.counters["captures"] != self._captures_seen:
            self._captures_seen = self.counters["captures"]
            torch.cuda.empty_cache()

    def layout(self) -> Dict[str, int]:
        """How many instances exist, of how many runs, writing their parameters' gradients
        into how many distinct buffer sets (one per run when they share, as they should)."""
        with self._lock:
            instances = [(k[0], inst) for k, e in self._entries.items() for inst in e.instances]
        sets = {id(inst.param_grad_out) for _, inst in instances}
        return dict(instances=len(instances), runs=len({run for run, _ in instances}), grad_buffer_sets=len(sets))

    def pool_labels(self) -> Dict[tuple, str]:
        """The graphs' memory pools, pool id -> "forward" (an instance's) or "backward" (the
        shared one): what the allocator's snapshot calls each segment's pool, so a benchmark
        can split the memory reserved (bench/pipeline_bench.py)."""
        with self._lock:
            labels = {tuple(inst.pool): "forward" for e in self._entries.values() for inst in e.instances}
            if self._backward_pool is not None:
                labels[tuple(self._backward_pool)] = "backward"
        return labels

    def release_all(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                for inst in entry.instances:
                    inst.busy = False

    def _key(self, run_id, modules, x) -> Optional[tuple]:
        if not (isinstance(x, torch.Tensor) and x.is_cuda and torch.is_grad_enabled()):
            return None
        if run_id in self._refused or torch.is_inference_mode_enabled():
            return None
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        return (run_id, tuple(x.shape), x.dtype, x.requires_grad, x.device.index, autocast)

    @staticmethod
    def _fingerprint(modules) -> tuple:
        """What a capture took as fixed besides the input's shape: every submodule's mode
        (a BatchNorm put in eval), which parameters need a gradient, and which tensors the
        parameters and buffers are (replaced ones, even on the same memory, start over)."""
        return RunView(modules).fingerprint()

    def view(self, run_id: tuple, modules: Sequence[nn.Module]) -> RunView:
        """The run's module view (run_view.py), walked again when its module tree changed.
        Called by the compute token's holder only."""
        view = self._views.get(run_id)
        if view is None or not view.current(modules):
            view = self._views[run_id] = RunView(modules)
        return view

    def _lease(self, key, modules, x) -> Optional[_Instance]:
        view = self.view(key[0], modules)
        fingerprint = view.fingerprint()
        restarts = 0
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            # Only a change of attributes alone counts toward MAX_ATTRIBUTE_RESTARTS: a mode
            # toggled for evaluation each epoch changes the fingerprint, and the run should
            # stay graphed.
            refit = entry.fingerprint != fingerprint
            changed = "" if refit or entry.attributes is None else entry.attributes.changed()
            if refit or changed:
                if any(i.busy for i in entry.instances):
                    return None
                entry.instances, entry.eager_calls, entry.fingerprint = [], 0, fingerprint
                entry.attributes = None
                if changed:
                    if entry.replays >= REPLAYS_THAT_FORGIVE:  # (a schedule's change once an epoch)
                        self._attribute_restarts[key[0]] = 0
                    restarts = self._attribute_restarts[key[0]] = self._attribute_restarts.get(key[0], 0) + 1
                entry.replays = 0
        if restarts > MAX_ATTRIBUTE_RESTARTS:
            # Changed from call to call (a counter, a schedule per step): capturing again
            # each time would cost more than it saves.
            self._refuse(key[0], f"its modules' attributes keep changing between calls ({changed}); "
                                 "a graph would replay the values of its capture")
            return None
        elif restarts:
            log.info("smp: CUDA graphs: %s is captured again: %s changed since its capture", key[0], changed)
        with self._lock:
            for inst in entry.instances:
                if not inst.busy:
                    inst.busy = True
                    entry.replays += 1
                    return inst
            if entry.eager_calls < WARMUP_CALLS:
                entry.eager_calls += 1
                return None
            if len(entry.instances) >= self.limit:
                self.counters["no_free_instance"] += 1
                return None
            if not entry.instances and sum(1 for k, e in self._entries.items()
                                           if k[0] == key[0] and e.instances) >= SHAPES_PER_RUN:
                return None
        try:
            inst = self._capture(key[0], modules, x, key[5])
        except NotGraphable as e:
            self._refuse(key[0], str(e))
            return None
        except CaptureFailed as e:  # a synchronizing call inside the run, say
            self._refuse(key[0], str(e))
            raise RuntimeError(f"smp: SMDDP_SMP_CUDA_GRAPHS=1, but CUDA refused to capture the run {key[0]} "
                               f"(a call inside it that synchronizes or allocates outside torch, say): {e}. "
                               "Set SMDDP_SMP_CUDA_GRAPHS=0 to run it eagerly") from e
        inst.busy = True
        with self._lock:
            if entry.attributes is None:
                entry.attributes = view.attributes()
            entry.instances.append(inst)
            self.counters["captures"] += 1
            self.counters["split_captures"] += inst.bwd_w is not None
        return inst

    def _capture(self, run_id, modules, x, autocast_dtype) -> _Instance:
        if self._stream is None:
            self._stream = torch.cuda.Stream(x.device)
        # A new pool once no graph uses the old one (after clear(), or after a run's instances
        # were dropped because its modules changed): torch frees a pool whose graphs are all
        # gone, and a capture into its handle would then fail.
        if self._backward_pool is None or not self.captured():
            self._backward_pool = torch.cuda.graph_pool_handle()
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        try:
            # The shared gradient buffers are made outside the capture (the general pool).
            params = [p for _, p in _named_params_needing_grad(modules)]
            inst = _Instance(modules, x, self._stream, autocast_dtype, self._backward_pool,
                             self._grad_buffers.get(run_id, params), self._accumulator, self.split_weights)
        finally:
            self._tls.depth -= 1
        if inst.not_split:
            with self._lock:
                first = run_id not in self._not_split
                self._not_split.add(run_id)
            if first:
                log.warning("smp: CUDA graphs: the backward of %s runs in one pass (its weights' gradients are "
                            "not deferred): %s", run_id, inst.not_split)
        return inst

    def _refuse(self, run_id, why: str) -> None:
        with self._lock:
            first = run_id not in self._refused
            self._refused[run_id] = why
        if first:
            log.warning("smp: CUDA graphs: %s runs eagerly: %s", run_id, why)
