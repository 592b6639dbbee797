"""smp.DistributedModel: the user's module, partitioned at the first smp.step."""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from collections import OrderedDict
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils.hooks import RemovableHandle

from . import grad_sync, partial_state
from .state_merge import everyone_has_own_part, merge_over_pipeline
from .activation_checkpointing import checkpoint_options, checkpointed
from .blas_workspaces import free_blas_workspaces
from .nested import is_mapping, mapping_like
from .optimizer import follow_parameters
from .partition import auto_assignment, describe, manual_assignment
from .runtime import PipelineRuntime, StepFailed
from .state import device as local_device, state
from .tied import TiedParameters
from .trace import Tracer
from .wire import Links


def _to(obj, dev):
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to(o, dev) for o in obj)
    if is_mapping(obj):
        return mapping_like(obj, ((k, _to(v, dev)) for k, v in obj.items()))
    return obj


def _compare_keys(expected: set, sd: Dict[str, Any], strict: bool) -> _IncompatibleKeys:
    """A state's keys against the whole model's, as torch reports them; with `strict` a
    mismatch raises."""
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if strict and (missing or unexpected):
        raise RuntimeError(f"smp: DistributedModel.load_state_dict: missing keys {missing[:8]}, unexpected keys "
                           f"{unexpected[:8]}" + (" (more not shown)" if len(missing) > 8 or len(unexpected) > 8
                                                   else ""))
    return _IncompatibleKeys(missing, unexpected)


class DistributedModel(nn.Module):
    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 overlapping_allreduce: bool = True, backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: float = 25,
                 trace_memory_usage: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False):
        state.require_init("smp.DistributedModel")
        if state.model is not None:
            raise RuntimeError("smp.DistributedModel: a model is already wrapped; the library manages one "
                               "DistributedModel per process")
        if not isinstance(module, nn.Module):
            raise TypeError(f"smp.DistributedModel expects a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError("smp.DistributedModel: TorchScript modules are not supported")
        if trace_device not in ("gpu", "cpu"):
            raise ValueError(f"smp.DistributedModel: trace_device must be 'gpu' or 'cpu', got {trace_device!r}")
        if trace_execution_times and trace_device == "cpu":
            raise ValueError("smp.DistributedModel: trace_execution_times needs trace_device='gpu'")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("smp.DistributedModel: backward_passes_per_step must be an integer >= 1")
        super().__init__()
        self.module = module
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times
        self.trace_memory_usage = trace_memory_usage  # (trace.py: counts what the backward keeps)
        # gradient_as_bucket_view is accepted for the original's scripts and changes no result:
        # the reduction copies each bucket back into .grad (docs/modelparallel.md).
        self.overlapping_allreduce = overlapping_allreduce
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.broadcast_buffers = broadcast_buffers
        self._partitioned = False
        self._owner_of_module: Dict[int, int] = {}
        self._owners_of_param: Dict[int, FrozenSet[int]] = {}  # more than one: tied (tied.py)
        self._tied = TiedParameters([])
        self._assignment: Dict[str, int] = {}
        self._post_partition_hooks: "OrderedDict[int, Any]" = OrderedDict()
        self._pending_state: Optional[Tuple[Dict[str, Any], bool, bool]] = None  # (state, strict, partial)
        self._runtime: Optional[PipelineRuntime] = None
        self._steps_with_backward = 0
        self._joining = False
        self._comm_hook: Tuple[Any, Any] = (None, None)
        self.last_reduction_overlapped = False  # whether the last reduction started inside the step
        state.model = self

    # -- what users call ---------------------------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def forward(self, *args, **kwargs):
        if state.tracing:
            return self.module(*args, **kwargs)
        if self._runtime is None:
            raise RuntimeError("smp: the DistributedModel was called outside an smp.step function (call it "
                               "inside the @smp.step function, which runs it once per microbatch)")
        return self._runtime.model_forward(args, kwargs)

    def backward(self, tensors, grad_tensors=None) -> None:
        """model.backward(loss) or model.backward(outputs, out_grads), inside smp.step."""
        if state.tracing:
            return
        if self._runtime is None:
            raise RuntimeError("smp: DistributedModel.backward was called outside an smp.step function")
        # As torch.autograd.backward: a lone tensor stands for a list of one, on either side
        # (list() of a tensor would split it along its first dimension).
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        tensors = list(tensors)
        grads = list(grad_tensors) if grad_tensors is not None else [None] * len(tensors)
        if len(grads) != len(tensors):
            raise ValueError(f"smp: model.backward got {len(tensors)} tensors but {len(grads)} gradients")
        self._runtime.model_backward(tensors, grads)

    def to(self, *args, **kwargs):
        # The library places each partition on its rank's device; moves are ignored, as in the
        # original. A dtype (model.to(torch.bfloat16), model.to(device, dtype)) is applied.
        _, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            self.module.to(dtype=dtype, non_blocking=non_blocking)
        return self

    def cuda(self, *args, **kwargs):
        return self

    def register_post_partition_hook(self, hook) -> RemovableHandle:
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def _is_local_module(self, m: nn.Module) -> bool:
        return self._owner_of_module.get(id(m), 0) == state.topo.pp_rank

    def local_named_modules(self) -> Iterator[Tuple[str, nn.Module]]:
        self._require_partitioned("local_named_modules")
        for name, m in self.module.named_modules():
            if self._is_local_module(m):
                yield name, m

    def local_modules(self) -> Iterator[nn.Module]:
        for _, m in self.local_named_modules():
            yield m

    def local_named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        self._require_partitioned("local_named_parameters")
        for name, p in self.module.named_parameters():
            if state.topo.pp_rank in self._owners_of_param[id(p)]:
                yield name, p

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.local_named_parameters():
            yield p

    def local_named_buffers(self) -> Iterator[Tuple[str, torch.Tensor]]:
        self._require_partitioned("local_named_buffers")
        for mname, m in self.module.named_modules():
            if self._is_local_module(m):
                for bname, b in m.named_buffers(recurse=False):
                    yield (f"{mname}.{bname}" if mname else bname), b

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, b in self.local_named_buffers():
            yield b

    def local_state_dict(self) -> Dict[str, Any]:
        return partial_state.mark(self._local_state())

    def _local_state(self) -> "OrderedDict[str, torch.Tensor]":
        """This partition's parameters and buffers (detached), without the partial marks."""
        self._require_partitioned("local_state_dict")
        local = {id(t) for t in [*self.local_parameters(), *self.local_buffers()]}
        return OrderedDict((k, v.detach()) for k, v in self.module.state_dict(keep_vars=True).items()
                           if id(v) in local)

    def state_dict(self, *args, **kwargs):
        """The whole model's state with the unwrapped module's keys, gathered from every
        pipeline rank (every rank of the pipeline group must call it)."""
        if not self._partitioned:
            return self.module.state_dict(*args, **kwargs)
        full = self.module.state_dict()
        full.update(merge_over_pipeline(self._local_state()))
        return full

    def load_state_dict(self, state_dict, strict: bool = True):
        """As torch's: returns the missing and unexpected keys (against the whole model), and
        with `strict` raises on them at the call. Before the partition the state is kept and
        loaded then; a partial state (smp.save(partial=True)) loads each rank's own part."""
        sd = dict(state_dict)
        partial = partial_state.take(sd, "DistributedModel.load_state_dict")
        expected = set(self.module.state_dict())
        keys = _IncompatibleKeys([], []) if partial else _compare_keys(expected, sd, strict)
        if not self._partitioned:
            self._pending_state = (sd, strict, partial)
            return keys
        local = set(self._local_state())
        if partial:
            if everyone_has_own_part(set(sd) == local):  # the usual case: no tensor moves
                missing, unexpected = self.module.load_state_dict(sd, strict=False)
                assert not unexpected and not local.intersection(missing), (unexpected, missing)
                return keys
            sd = merge_over_pipeline(sd)  # saved under another assignment of modules to partitions
            keys = _compare_keys(expected, sd, strict)
        # A full state: only this partition's entries are copied (the other partitions' live on
        # their ranks; copying them here would read and write the whole model on every rank).
        self.module.load_state_dict({k: v for k, v in sd.items() if k in local or k not in expected}, strict=False)
        return keys

    def cpu(self):
        """Gathers every partition's parameters and buffers into this process, on the CPU."""
        full = self.state_dict()
        self.module.load_state_dict(full)
        self.module.to("cpu")
        return self

    def _require_partitioned(self, what: str) -> None:
        if not self._partitioned:
            raise RuntimeError(f"smp: DistributedModel.{what}() is available once the model is partitioned "
                               "(at the first smp.step call)")

    # -- partition (first smp.step) -------------------------------------------------------------------
    def _partition(self, fn, first_microbatch) -> None:
        cfg, topo = state.cfg, state.topo
        parts = topo.pp_size
        if parts == 1:
            assignment = {p: 0 for p, _ in self.module.named_modules()}
        elif cfg.auto_partition:
            assignment = self._auto_partition(fn, first_microbatch)
        else:
            assignment = manual_assignment(self.module, cfg.default_partition)
            self._check_agreement(assignment)  # (the automatic one is rank 0's, broadcast)
        self._install(assignment)
        self._partitioned = True
        if topo.rank == 0 and parts > 1:
            print(describe(self.module, assignment, parts), flush=True)  # as the original logs it
        dev = local_device()
        for m in self.local_modules():
            for p in m.parameters(recurse=False):
                p.data = p.data.to(dev)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = b.to(dev)
        self._release_other_partitions()
        for opt in state.optimizers:
            follow_parameters(opt)
        self._tied = TiedParameters.build(self.module, self._owners_of_param, topo)
        self._tied.synchronize_values()
        if cfg.ddp and topo.dp_size > 1:
            tensors = [p for p in self.local_parameters()]
            if self.broadcast_buffers:
                tensors += [b for b in self.local_buffers()]
            grad_sync.broadcast_from_first(tensors, state.dp_group, topo.dp_group[0])
        if self._pending_state is not None:
            sd, strict, partial = self._pending_state
            self._pending_state = None
            self.load_state_dict(dict(sd, _smp_is_partial=True) if partial else sd, strict=strict)
        for hook in list(self._post_partition_hooks.values()):
            hook(self)

    def _release_other_partitions(self) -> None:
        """Parameters and buffers that other ranks own go to the CPU: a model moved to the GPU
        before it was wrapped (manual partitioning keeps it where it is) would otherwise hold
        the whole model on every rank's GPU."""
        local = {id(t) for t in self.local_parameters()} | {id(t) for t in self.local_buffers()}
        cpu = torch.device("cpu")
        for m in self.module.modules():
            for p in m.parameters(recurse=False):
                if id(p) not in local and p.device != cpu:
                    p.data = p.data.to(cpu)
            for name, b in list(m._buffers.items()):
                if b is not None and id(b) not in local and b.device != cpu:
                    m._buffers[name] = b.to(cpu)

    def _auto_partition(self, fn, first_microbatch) -> Dict[str, int]:
        cfg = state.cfg
        trace_dev = local_device() if self.trace_device == "gpu" else torch.device("cpu")
        args, kwargs = _to(first_microbatch, trace_dev)
        self.module.to(trace_dev)  # also a model moved to a GPU before it was wrapped, when tracing on the CPU
        rng_devices = [trace_dev] if trace_dev.type == "cuda" else []
        # The trace is a forward the user did not ask for: buffers it updates (BatchNorm's
        # running statistics) are put back as they were.
        buffers_before = [(m, name, b.detach().clone()) for m in self.module.modules()
                          for name, b in m._buffers.items() if b is not None]
        try:
            # With trace_memory_usage autograd records the forward, to count what it saves.
            with torch.random.fork_rng(devices=rng_devices), torch.set_grad_enabled(self.trace_memory_usage), \
                    Tracer(self.module, self.trace_execution_times, self.trace_memory_usage) as tracer:
                state.tracing = True
                try:
                    fn(*args, **kwargs)
                finally:
                    state.tracing = False
        finally:
            if trace_dev.type != "cpu":
                self.module.to("cpu")
            with torch.no_grad():
                for m, name, before in buffers_before:
                    now = m._buffers.get(name)
                    if now is not None and now.shape == before.shape:
                        now.copy_(before)
                    else:  # the forward replaced it
                        m._buffers[name] = before.to(now.device if now is not None else "cpu")
        if trace_dev.type == "cuda":
            free_blas_workspaces()  # the trace ran the whole model on this thread; the stages compute on others
        assignment = auto_assignment(self.module, tracer.trace, state.topo.pp_size, cfg.memory_weight)
        # Rank 0 decides: measured times differ between ranks, and so do activation sizes
        # when replicas' first batches differ in shape (dynamic padding).
        box = [assignment]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _check_agreement(self, assignment: Dict[str, int]) -> None:
        digest = hashlib.sha256(repr(sorted(assignment.items())).encode()).hexdigest()
        everyone: List[Any] = [None] * state.topo.size
        dist.all_gather_object(everyone, digest)
        if len(set(everyone)) != 1:
            differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
            raise RuntimeError(f"smp: ranks {differ} chose a different partition from rank 0 (different "
                               "models or smp.partition contexts on different ranks?)")

    def _install(self, assignment: Dict[str, int]) -> None:
        topo = state.topo
        me = topo.pp_rank
        self._assignment = dict(assignment)
        for path, m in self.module.named_modules():
            self._owner_of_module[id(m)] = assignment[path]
        holders: Dict[int, Tuple[str, set]] = {}
        for path, m in self.module.named_modules():
            for name, p in m.named_parameters(recurse=False):
                full = f"{path}.{name}" if path else name
                holders.setdefault(id(p), (full, set()))[1].add(assignment[path])
        for pid, (_, owners) in holders.items():
            self._owners_of_param[pid] = frozenset(owners)  # several: tied weights, a copy on each (tied.py)
        links = Links(state.pp_group, topo.pp_group, me, state.cuda_links, local_device(), state.host_staged_links)
        cfg = state.cfg
        runtime = PipelineRuntime(links, me, topo.pp_size, topo.pp_group, cfg.pipeline, cfg.active_microbatches,
                                  local_device())
        runtime.root = self.module
        runtime.root_owner = assignment[""]
        runtime.window = self._stage_window(assignment, me, topo.pp_size, runtime.output_backward)
        runtime.window_by_depth = not self._rank_ordered(assignment, topo.pp_size)
        runtime.remote_module_ids = {id(m) for path, m in self.module.named_modules() if assignment[path] != me}
        for path, m in self.module.named_modules():
            runtime.modules[path] = m
            owner = assignment[path]
            # Only Sequential's own forward is a chain of children; a subclass may define another.
            chain = isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward
            original = self._sequential_forward(m, path, runtime) if chain else m.forward
            spans = len({assignment.get(f"{path}.{q}" if path else q, owner) for q, _ in m.named_modules()}) > 1
            m.forward = self._dispatching_forward(runtime, m, path, owner, original, me, spans)
            if owner != me:
                # A module's hooks run once, on its owner, which serves the call through
                # module(...). Here the call skips them: run on both ranks, a hook that changes
                # inputs, outputs or gradients would apply twice, and one that reads the
                # module's parameters (pruning's, weight norm's) would read stale copies.
                m._call_impl = m.forward
        self._runtime = runtime

    def _stage_window(self, assignment: Dict[str, int], me: int, pp_size: int, output_backward: bool):
        """How many microbatches this rank's stage holds at once under "interleaved", as 1F1B's
        stage k does (p - k), when the root is a plain Sequential whose children pass through
        the partitions once each in rank order, so that rank k is stage k. One more on the
        last stage when the root, not the last stage, computes the loss (it answers a round
        trip later). None on the root's rank, and for other layouts, where a rank's place in
        the pipeline is not its rank: the runtime bounds those by the depth each call reports
        (_depth_window)."""
        if me == 0 or not self._rank_ordered(assignment, pp_size):
            return None
        return pp_size - me + (0 if output_backward or me < pp_size - 1 else 1)

    def _rank_ordered(self, assignment: Dict[str, int], pp_size: int) -> bool:
        """Whether the root is a plain Sequential on rank 0 whose children pass through the
        partitions once each in rank order."""
        root = self.module
        if assignment[""] != 0 or not (isinstance(root, nn.Sequential)
                                       and type(root).forward is nn.Sequential.forward):
            return False
        owners = [assignment[name] for name, _ in root.named_children()]
        return [o for i, o in enumerate(owners) if i == 0 or owners[i - 1] != o] == list(range(pp_size))

    @staticmethod
    def _dispatching_forward(runtime: PipelineRuntime, module: nn.Module, path: str, owner: int, original,
                             me: int, spans_partitions: bool):
        def forward(*args, **kwargs):
            if owner != me:
                return runtime.call_remote(owner, path, None, args, kwargs)
            if checkpoint_options(module) is not None:
                if spans_partitions:
                    raise RuntimeError(f"smp: module '{path or '<root>'}' is marked for activation checkpointing "
                                       "but has submodules on other partitions; mark modules within one partition")
                return checkpointed(module, original, args, kwargs)
            return original(*args, **kwargs)

        return forward

    def _sequential_forward(self, seq: nn.Sequential, path: str, runtime: PipelineRuntime):
        """A run of consecutive children on one partition is one remote call, not one per child,
        and consecutive runs on other partitions are one chained call (runtime.call_remote)."""
        me = state.topo.pp_rank
        owners = [self._owner_of_module[id(c)] for c in seq]
        runs = []  # (owner, first child, end)
        for i, owner in enumerate(owners):
            if runs and runs[-1][0] == owner:
                runs[-1] = (owner, runs[-1][1], i + 1)
            else:
                runs.append((owner, i, i + 1))

        def forward(x):
            children = list(seq)
            k = 0
            while k < len(runs):
                owner, i, j = runs[k]
                if owner == me:
                    x = runtime.run_local_children((path, i, j), children[i:j], x)
                    k += 1
                    continue
                n = k + 1
                while runtime.chain_calls and n < len(runs) and runs[n][0] != me:
                    n += 1
                # The root's last children, when remote, produce the model's output itself:
                # their owner may start the backward from its own copy of the loss.
                x = runtime.call_remote(owner, path, (i, j), (x,), {},
                                        produces_output=(path == "" and runs[n - 1][2] == len(children)),
                                        chain=[(o, (a, b)) for o, a, b in runs[k + 1:n]])
                k = n
            return x

        return forward

    # -- a step ------------------------------------------------------------------------------------
    def _norm_counted_elsewhere(self) -> set:
        """Parameters of this rank that another rank counts in a whole-model gradient norm."""
        return self._tied.counted_elsewhere(state.topo.pp_rank)

    def _reduced_parameter_sets(self) -> List[List[nn.Parameter]]:
        """This partition's parameters in the data-parallel reductions, in their order: the
        untied ones (started early with overlapping_allreduce), then the tied ones (after their
        sum over partitions, tied.py). A joined replica mirrors the same reductions."""
        # Frozen parameters take no part, as under torch DDP: a zero gradient given to one would
        # still move it under weight decay.
        untied = [p for p in self.local_parameters() if p.requires_grad and not self._tied.is_tied(p)]
        tied = [p for p in self._tied.local if p.requires_grad]
        return [untied, tied] if tied else [untied]

    def _run_step(self, fn, microbatches, grad_enabled: bool, autocast) -> List[Any]:
        rt = self._runtime
        cfg, topo = state.cfg, state.topo
        reductions = []
        if cfg.ddp and topo.dp_size > 1 and (self._steps_with_backward + 1) % self.backward_passes_per_step == 0:
            reductions = [grad_sync.GradientReduction(params, state.dp_group, topo.dp_size, self.bucket_bytes,
                                                      *self._comm_hook)
                          for params in self._reduced_parameter_sets()]
        # A joining replica announces before each reduction, so its reductions wait for the step.
        early = bool(reductions) and self.overlapping_allreduce and not self._joining
        rt.on_grads_final = (lambda: reductions[0].launch(early=True)) if early else None
        self._tied.begin_step()
        try:
            results = rt.run_step(fn, microbatches, self.average_grads_across_microbatches, grad_enabled, autocast,
                                  cfg.pipeline, cfg.active_microbatches)
        except BaseException:
            self._tied.restore()
            raise
        finally:
            rt.on_grads_final = None
        if rt.backward_seen:
            self._tied.end_step()
        else:
            self._tied.restore()
        if rt.backward_seen and cfg.ddp and topo.dp_size > 1:
            self._steps_with_backward += 1
            if reductions:
                if self._joining:
                    grad_sync.announce(state.dp_group, training=True)
                who = f"pipeline rank {topo.pp_rank} (global rank {topo.rank})"
                try:
                    reductions[0].launch()  # (a no-op when it started early)
                    if not self._joining:  # joined replicas reduce zeros for steps they do not run
                        grad_sync.check_replicas_in_step(state.dp_check_group, state.step_calls, who, topo.dp_group)
                    for reduction in reductions:  # in order: the first may have started early
                        reduction.finish()
                except StepFailed:
                    raise
                except RuntimeError as e:
                    raise StepFailed(grad_sync.reduction_failure(who, topo.dp_group, e)) from e
                self.last_reduction_overlapped = reductions[0].launched_early
        return results

    def register_comm_hook(self, state_: Any, hook) -> None:
        """A torch DDP communication hook, `hook(state, bucket) -> Future[Tensor]`, run on each
        gradient bucket in place of averaging it over the data-parallel group ('ddp': true). The
        bucket has torch GradBucket's methods (buffer, set_buffer, index, is_last, parameters,
        gradients). torch's hooks read a `state` of None as the world group; here None is the
        data-parallel group, the only group whose replicas hold the same parameters."""
        if not state.cfg.ddp:
            raise RuntimeError("smp: register_comm_hook is for data parallelism across replicas ('ddp': true)")
        if not callable(hook):
            raise TypeError(f"smp: register_comm_hook expects a callable hook, got {type(hook).__name__}")
        if self._comm_hook != (None, None):
            raise RuntimeError("smp: register_comm_hook can only be called once (as in torch DDP)")
        self._comm_hook = (hook, state.dp_group if state_ is None else state_)

    @contextmanager
    def join(self):
        """Training with uneven inputs across model replicas (ddp: true): a replica that runs
        out of batches keeps taking part in the others' gradient reductions, with zeros, when
        it leaves the context, until every replica has left it."""
        cfg, topo = state.cfg, state.topo
        if not cfg.ddp:
            raise RuntimeError("smp: DistributedModel.join() is for data parallelism across replicas ('ddp': true)")
        if topo.dp_size == 1:
            yield
            return
        self._joining = True
        try:
            yield
        except BaseException:
            self._joining = False
            raise  # this rank fails: the others learn it from the engine, not from a wrong join
        self._joining = False
        self._require_partitioned("join")
        # The replicas' step counts differ by design after uneven inputs: all continue from the largest.
        state.step_calls = grad_sync.shadow_until_all_joined(
            self._reduced_parameter_sets(), list(self.local_buffers()), state.dp_group, topo.dp_group, topo.dp_size,
            self.bucket_bytes, self._steps_with_backward, state.step_calls, *self._comm_hook)
