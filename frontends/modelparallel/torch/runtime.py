"""The pipeline runtime: module calls across partitions, a distributed backward, and steps.

After partitioning, each module belongs to one pipeline rank (its partition). A module's
forward always runs on its owner: when running code calls a module owned elsewhere, the
arguments go to the owner, which runs the call and sends the outputs back (a remote call).
The root module runs on its owner for each microbatch; its outputs go to every pipeline rank,
so every rank runs the user's step function to the end (loss and all) and every rank gets
the StepOutputs, as in the original. Any Python forward works this way: a child called twice,
a skip connection across partitions, dict outputs, calls back into an earlier partition.
nn.Sequential is special-cased: a run of consecutive children on one partition is one call.

Backward. Each remote call records the caller's input tensors and the outputs it received,
which are fresh leaves. model.backward(loss) runs autograd locally from the loss, then visits
the microbatch's remote calls in reverse order: it sends the gradients collected on a call's
outputs to the call's owner, which runs its own backward the same way (its own remote calls
included) and returns the gradients of the call's inputs; the caller continues autograd from
those inputs. A call's inputs can only depend on earlier calls' outputs, so reverse call order
visits every call after all gradient that reaches it has arrived. Autograd never blocks inside
a backward function (so CUDA's autograd threads are never held), and graphs are retained
until the microbatch ends because a skip connection can be traversed by two segments.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import pickle
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from smdistributed.common import config

from . import cuda_streams
from .blas_workspaces import free_blas_workspaces
from .held_answers import HeldAnswer, HeldAnswers
from .stall_report import StallReport
from .scheduler import BACKWARD, FORWARD, ArrivalOrder, ComputeToken, Waiter, priority
from .stage_graphs import StageGraphs
from .wire import Links, Message, QuietLink, decode, encode, take
from .timeline import Timeline
from .workers import TaskHandle, WorkerPool


class StepFailed(RuntimeError):
    """A pipeline step failed on some rank; raised on every rank of the pipeline."""


# A call's id: (the pipeline rank that issued it, the step, a count). The step makes a message
# that arrives after its step ended (model.backward called on some ranks only) an error instead
# of the answer to a call of the next step.
CallId = Tuple[int, int, int]


@dataclass
class RemoteCall:
    call_id: CallId
    owner: int
    what: str
    inputs: List[torch.Tensor]      # the caller's tensors that need a gradient back
    outputs: List[torch.Tensor]     # leaves for the owner's outputs (none if the owner starts the backward)
    owner_starts_backward: bool  # the owner computed the loss itself (see call_remote)
    # Who holds the outputs' graph, and its frame there: the owner and this call, or for a
    # chain the last hop and its frame (call_remote).
    bwd_owner: int
    bwd_id: CallId


@dataclass
class Task:
    """One thread's work: a microbatch's step function, or a call served for a peer."""
    mb: int
    phase: str
    kind: str = "step"  # "step": the user's step function; "serve": a call for a peer
    queue: str = ""  # a served call: the queue it came from ("fwd" or "bwd")
    calls: List[RemoteCall] = field(default_factory=list)
    model_calls: int = 0
    reached_backward: bool = False
    backward_called: bool = False  # model.backward ran in this microbatch (once only)
    output_producer: Optional[int] = None  # the rank that keeps this model call's output (call_remote)
    leases: List[Any] = field(default_factory=list)  # graph instances its forward used (stage_graphs.py)
    # The root's step function: pipeline ranks in the order this microbatch's forward first
    # reached them (None: not followed, as for served calls, whose onward calls are not
    # windowed); see _depth_window.
    visits: Optional[List[int]] = None
    drops: List[Tuple[int, Any]] = field(default_factory=list)  # a served hop's "drop" messages (_serve_forward)

    def __str__(self) -> str:  # its label in the timeline and in stall reports
        return f"{self.kind} {self.phase} mb{self.mb}"


@dataclass
class ServedFrame:
    inputs: List[torch.Tensor]
    outputs: List[torch.Tensor]
    calls: List[RemoteCall]
    leases: List[Any] = field(default_factory=list)  # freed when its backward is done
    # A hop of a chain after the first: the previous hop's frame, which takes this frame's
    # input gradients as its own backward request (None: they go back to the caller).
    parent: Optional[CallId] = None
    origin: Optional[Tuple[int, CallId]] = None  # (caller, call id) that the chain answers
    mb: int = -1
    windowed: bool = False  # counted in the stage's window until its backward (_enter_window)


@dataclass
class OwnOutputCall:
    """The root's call that makes the model output here, handed to the step function thread
    that waits for that output, which serves it itself (PipelineRuntime._route_forward).
    `ticket`: its place in the order forward calls arrived in (scheduler.ArrivalOrder)."""
    call: tuple  # (src, msg, tensors, specs, ready), as a serve runner gets it
    ticket: int


_local = threading.local()


def _grads_or_zeros(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor's gradient, zeros where none reached it: the gradients a peer seeds its
    backward of these tensors with."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]


def autocast_state() -> Dict[str, Any]:
    """The autocast in force on this thread, device type -> dtype (empty when off)."""
    out = {}
    for device_type in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device_type):
                out[device_type] = torch.get_autocast_dtype(device_type)
        except (TypeError, RuntimeError):
            pass
    return out


def current_task() -> Optional[Task]:
    return getattr(_local, "task", None)


class PipelineRuntime:
    def __init__(self, links: Links, pp_rank: int, pp_size: int, global_ranks: List[int], pipeline: str,
                 active_microbatches: int, device: torch.device):
        self.links = links
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.global_ranks = global_ranks
        self.pipeline = pipeline
        self.active = active_microbatches
        self.device = device
        self.modules: Dict[str, torch.nn.Module] = {}  # path -> module, for served calls
        self.root_owner = 0
        self.root: Optional[torch.nn.Module] = None
        self._broken: Optional[str] = None
        self._step = 0  # steps started; every rank of the pipeline runs the same ones
        # Called once per step, on a worker thread, when no more gradient can reach this rank's
        # parameters this step (overlapping_allreduce starts the data-parallel reduction there).
        self.on_grads_final: Optional[Callable[[], None]] = None
        self._pool = WorkerPool(device)
        # Served calls run on threads of their own pool, one runner per kind of call taking them
        # in arrival order (another only while one waits for a peer). A thread that ever ran a
        # matrix product holds a cuBLAS workspace (32 MiB on Hopper) for life: a thread per
        # served call held one per microbatch on the last stage (16 at m = 16); this keeps the
        # threads that compute few and the same from step to step.
        self._serve_pool = WorkerPool(device)
        self._pool.on_task_error = self._serve_pool.on_task_error = self._task_escaped
        links.aborted = self.aborted  # a send waiting for its turn gives up when the step fails
        self.output_backward = config.value("SMDDP_SMP_OUTPUT_BACKWARD") != "0"
        self.chain_calls = config.value("SMDDP_SMP_CHAIN_CALLS") != "0"  # see call_remote
        self.chained_hops = 0  # forwards this rank passed straight to the next hop of a chain, ever
        # The last stage's step function serves the call that makes its own model output,
        # instead of a serve runner handing the output over (_route_forward).
        self.inline_output = config.value("SMDDP_SMP_INLINE_OUTPUT") != "0"
        self.inline_output_serves = 0  # calls served that way, ever
        # The last stage's answers to the root wait for the input gradients, to leave in their
        # message (held_answers.py); 0: they leave at once.
        self.held_answers = HeldAnswers(float(config.value("SMDDP_SMP_HOLD_ANSWER_MS")) / 1e3, self._send_held_alone,
                                        self._held_answer_failed, device)
        self.output_backwards = 0  # microbatches whose backward this rank started from its own loss, ever
        self.timeline = Timeline(global_ranks[pp_rank])
        if self.timeline.enabled:
            links.timeline = self.timeline
        self.graphs = StageGraphs(config.value("SMDDP_SMP_CUDA_GRAPHS") == "1" and device.type == "cuda",
                                  split_weights=config.value("SMDDP_SMP_DEFER_WEIGHT_GRADS") == "1")
        self._frees_blas_workspaces = (device.type == "cuda"
                                       and config.value("SMDDP_SMP_FREE_BLAS_WORKSPACES") == "1")
        self.remote_module_ids: set = set()  # id() of every module other ranks own (set by the model)
        # Microbatches this stage may hold at once under "interleaved", set by the model when the
        # root is a chain of stages in rank order (see _enter_window); None: each call's depth
        # bounds it (_depth_window).
        self.window: Optional[int] = None
        self.window_by_depth = False  # set by the model for layouts other than that chain
        self._local_runs: Dict[tuple, tuple] = {}  # run -> (its module view, whether none of it is remote)
        self.stall = StallReport(float(config.value("SMDDP_STALL_WARNING")))
        self.stall.header = lambda: (f"pipeline rank {self.pp_rank} (global rank {self.global_ranks[self.pp_rank]}), "
                                     f"step {self._step}")
        self._reset()

    # -- step --------------------------------------------------------------------------------
    def _free_blas_workspaces(self) -> None:
        """Each thread's cuBLAS workspaces go when it lets go of the token (blas_workspaces.py).
        Not while stage graphs exist (enabled or not): a captured graph may use a workspace made
        before its capture, and its replays would write memory given to others."""
        if not self.graphs.enabled and not self.graphs.captured():
            free_blas_workspaces()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._abort_sent = False
        self._token = ComputeToken(self.aborted, self.timeline if self.timeline.enabled else None,
                                   self._free_blas_workspaces if self._frees_blas_workspaces else None)
        self._waiters: Dict[Any, Waiter] = {}
        self._frames: Dict[CallId, ServedFrame] = {}
        self._served_mbs: set = set()  # microbatches with a frame served here this step
        self._window_live: Dict[int, int] = {}  # mb -> its frames here and its forwards being served
        self._window_waiting: collections.Counter = collections.Counter()  # mb -> its forwards waiting
        self._window_backed: set = set()  # microbatches that had a frame's backward here this step
        # The first microbatch's visiting order this step, which the others' must follow to be
        # windowed by depth (the root's; see _visits_for).
        self._visit_reference: List[int] = []
        self._ids = itertools.count()
        self._threads: List[TaskHandle] = []
        self._serve_queues: Dict[str, collections.deque] = {"fwd": collections.deque(), "bwd": collections.deque()}
        self._serve_runners = {"fwd": 0, "bwd": 0}  # runners not waiting for a peer
        self._flow = threading.Condition()
        self._started = 0
        self._first_computed = 0  # microbatches that have taken the compute token once
        # mb -> set once microbatch mb - 1 has computed (_acquire_in_order); each waiting thread
        # sleeps on its own, instead of every change of _flow waking all of them.
        self._first_turns: Dict[int, threading.Event] = {}
        # Set when a microbatch finishes or the step fails: what the root's admission waits for.
        self._a_microbatch_ended = threading.Event()
        # mb -> (id of the served call that made its output, the call its caller waits on)
        self._output_frames: Dict[int, Tuple[CallId, Tuple[int, CallId]]] = {}
        self._finished = 0
        self._ended_mbs: set = set()  # microbatches whose step function returned here (under _lock)
        self._arrivals = ArrivalOrder()  # forward calls' arrival order, kept across threads (_route_forward)
        self._at_backward = 0
        self._serving_backward = 0
        self._grads_final_fired = False
        self.backward_seen = False
        self._root_ended = False  # the root's "end" of this step arrived (a rank other than the root)
        self.stall.new_step()

    def aborted(self) -> Optional[BaseException]:
        return self._error

    def _task_escaped(self, e: BaseException) -> None:
        """A task let an error escape its own handling: the step fails on every rank (what the
        task was to deliver would otherwise be waited for forever)."""
        self._abort(e if isinstance(e, StepFailed) else StepFailed(self._describe("a pipeline thread raised", e)))

    def run_step(self, fn: Callable, microbatches: List[Tuple[tuple, dict]], average: bool,
                 grad_enabled: bool, autocast: Dict[str, Any], pipeline: str, active: int) -> List[Any]:
        if self._broken is not None:
            raise StepFailed(f"smp.step: an earlier step failed ({self._broken}); the pipeline cannot continue")
        self._step += 1
        started = time.perf_counter()  # the step's span in the timeline
        self._reset()
        # Nothing of an earlier step that left through an exception may be added to this one's.
        self.graphs.discard_gradients()
        # Enough workers for every task this step can have at once: microbatches and receivers
        # (served calls run on their own pool).
        self._pool.ensure(len(microbatches) + self.pp_size + 1)
        self.pipeline, self.active = pipeline, active
        self.num_microbatches = len(microbatches)
        # A graphed run needs an instance per microbatch in flight on this stage.
        self.graphs.limit = len(microbatches) if pipeline == "simple" else min(active, len(microbatches))
        self.grad_scale = 1.0 / len(microbatches) if average else 1.0
        self._autocast = autocast
        results: List[Any] = [None] * len(microbatches)
        receivers = [self._spawn(self._receive_loop, p, name=f"smp-recv-{p}")
                     for p in range(self.pp_size) if p != self.pp_rank]
        workers = []
        try:
            for mb, (args, kwargs) in enumerate(microbatches):
                # The root admits a microbatch before it takes a thread: with "interleaved" at
                # most `active_microbatches` microbatch threads exist at once, so at most that
                # many threads run the root's forward and hold a cuBLAS workspace each.
                if self.pp_rank == self.root_owner and not self._admitted(mb):
                    break  # the step failed: what was started is joined below
                workers.append(self._spawn(self._run_microbatch, fn, mb, args, kwargs, results, grad_enabled,
                                           name=f"smp-mb-{mb}"))
            for t in workers:
                self._join(t)
            if self.pp_rank != self.root_owner:
                self._join(receivers[self._peer_index(self.root_owner)])
            # Nothing more goes out from here this step: the root knows all work is done when
            # its microbatches finish; the others, when the root says so and theirs finish.
            if self._error is None:
                self._send_all(Message("end"))
            for t in receivers:
                self._join(t)
            self._join_all()
            with self._lock:
                unasked = [w.unclaimed() for k, w in self._waiters.items() if k[0] == "bwd_done"]
            # (A skipped backward's answer has no body: an evaluation step's, never asked for.)
            stray = [v for v in unasked if v is not None and v[0] is not None]
            if stray and self._error is None:  # the others learn it from the abort, at their next step
                self._abort(StepFailed(self._uneven_backward(
                    f"pipeline rank {self.pp_rank} got input gradients of {len(stray)} call(s) whose backward "
                    "it never asked for")))
        except BaseException as e:  # KeyboardInterrupt on this rank: tell the others
            self._abort(e)
            raise
        finally:
            self.graphs.release_all()  # frames that never had a backward (evaluation, a failure)
            self.held_answers.drop_step(self._step)  # a failed step's (see drop_step)
        if self._error is None:
            try:
                self.graphs.flush_gradients()
            except BaseException as e:  # out of memory, say: the step failed here
                self._abort(StepFailed(self._describe("adding the graphed runs' gradients to .grad", e)))
            else:
                self.graphs.after_step()
        if self._error is not None:
            self._broken = str(self._error)
            if isinstance(self._error, StepFailed):
                raise self._error
            raise StepFailed(str(self._error)) from self._error
        self._frames.clear()
        self.timeline.add(f"step {self._step}", "step", started, time.perf_counter())
        self.timeline.flush()
        return results

    def _peer_index(self, p: int) -> int:
        return p if p < self.pp_rank else p - 1

    def _join(self, t: TaskHandle) -> None:
        """Joins `t`; meanwhile, a rank whose step waits with nothing moving says what waits."""
        while not t.join(0.5):
            self.stall.check(self._token, self._stall_extra)

    def _stall_extra(self) -> List[str]:
        """What else this rank waits for, for a stall report: a rank other than the root, the
        root's next message once the step's first arrived (before that the root may be busy
        outside the step); and who holds this stage's window places."""
        extra = []
        if self.pp_rank != self.root_owner and self.stall.heard_this_step and not self._root_ended:
            extra.append(f"pipeline rank {self.root_owner}'s next message of this step (the root's)")
        with self._flow:
            if self._window_waiting:
                extra.append(f"microbatches {sorted(self._window_live)} hold this stage's window places")
        return extra

    def _join_all(self) -> None:
        """Joins every task of the step, including any started while joining."""
        joined = 0
        while True:
            with self._lock:
                pending = self._threads[joined:]
            if not pending:
                return
            for t in pending:
                self._join(t)
            joined += len(pending)

    def _spawn(self, target, *args, name: str, pool: Optional[WorkerPool] = None) -> TaskHandle:
        handle = (pool or self._pool).submit(target, *args)
        with self._lock:
            self._threads.append(handle)
        return handle

    def _run_microbatch(self, fn, mb, args, kwargs, results, grad_enabled) -> None:
        _local.task = task = Task(mb, FORWARD, visits=[self.pp_rank] if self.pp_rank == self.root_owner else None)
        try:
            with torch.set_grad_enabled(grad_enabled), self._autocast_context():
                self._acquire_in_order(task)
                try:
                    results[mb] = fn(*args, **kwargs)
                finally:
                    self._token.release()
        except BaseException as e:
            self._abort(e if isinstance(e, StepFailed) else
                        StepFailed(self._describe(f"the step function of microbatch {mb} raised", e)))
        finally:
            _local.task = None
            self._strand_own_output(mb)
            self.graphs.release(task.leases)  # its backward on this rank is done
            # An answer still held (no model.backward here) leaves now: after this microbatch
            # ends, this rank's "end" could overtake it. (A failed step's stays; see drop_step.)
            try:
                self.held_answers.flush((self._step, mb), self.aborted)
            except BaseException as e:
                self._held_answer_failed(e)
            with self._lock:
                unstarted = self._output_frames.pop(mb, None)
            if unstarted is not None and self._error is None:
                # No backward here (an evaluation step, say): the caller gets an empty answer,
                # an error only if it does wait for this backward (backward on some ranks only).
                caller, call_id = unstarted[1]
                try:
                    self.links.send(caller, Message("bwd_done", {"id": call_id}, None))
                except BaseException as e:
                    self._abort(StepFailed(self._describe("sending a skipped backward", e)))
            with self._flow:
                self._finished += 1
                if not task.reached_backward:
                    self._at_backward += 1
                if not task.backward_called:  # its frames here will have no backward this step
                    self._window_live.pop(mb, None)
                self._flow.notify_all()
                self._a_microbatch_ended.set()
            self._check_grads_final()

    def _acquire_in_order(self, task: Task) -> None:
        """A microbatch's first compute waits for the previous microbatch's first: the threads
        start together, and whichever the OS ran first would otherwise take the token (measured:
        the root sent microbatch 2's forward before microbatch 0's, and every stage after it
        worked out of order, delaying the first backward)."""
        if self._first_computed < task.mb:  # (it only grows: once enough, no need to wait or lock)
            with self._flow:
                turn = self._first_turns.setdefault(task.mb, threading.Event())
                if self._first_computed >= task.mb:
                    turn.set()
            with self.stall.waiting("microbatch {}: microbatch {}'s first compute", task.mb, task.mb - 1):
                while self._first_computed < task.mb:
                    if self._error is not None:
                        raise self._error
                    turn.wait(0.5)
        self._token.acquire(self._prio(task), self._label(task))
        with self._flow:
            if self._first_computed < task.mb + 1:  # (it was task.mb: only the next one can go now)
                self._first_computed = task.mb + 1
                turn = self._first_turns.pop(task.mb + 1, None)
                if turn is not None:
                    turn.set()

    def _check_grads_final(self) -> None:
        """This rank's gradients are final once its microbatches have all run their step
        function (so every forward call of the step, here included, has been served: the root's
        outputs come after them) and every served call whose outputs need a gradient has had its
        backward (each gets exactly one: the caller's backward visits all its recorded calls).
        The root rank gets there last, when the whole step's backward is done."""
        with self._lock:
            if (self._grads_final_fired or self.on_grads_final is None or not self.backward_seen
                    or self._error is not None or self._finished < self.num_microbatches or self._frames
                    or self._serving_backward):
                return
            self._grads_final_fired = True
        self.graphs.flush_gradients()  # the graphed runs' share, before the reduction reads .grad
        self.on_grads_final()

    def _admitted(self, mb: int) -> bool:
        """Waits until microbatch `mb` may start (False: the step failed meanwhile).
        Microbatches start in order; interleaved: at most `active_microbatches` of them
        between start and finish. (In order, or a later microbatch could take the last slot and
        then wait for an earlier one to compute first, which waits for the slot.)"""
        with self.stall.waiting("microbatch {}: its start (active_microbatches in flight)", mb):
            while True:
                with self._flow:
                    # (Cleared before the check: a microbatch that ends after it sets it again.)
                    self._a_microbatch_ended.clear()
                    if self._error is not None:
                        return False
                    if self._started == mb and (self.pipeline != "interleaved" or
                                                self._started - self._finished < self.active):
                        self._started += 1
                        return True
                self._a_microbatch_ended.wait(0.5)

    @staticmethod
    def _label(task: Optional[Task]) -> str:
        return "" if task is None else str(task)

    def _prio(self, task: Task):
        return priority(task.phase, task.mb, self.pipeline)

    def _autocast_context(self, autocast: Optional[Dict[str, Any]] = None):
        """The step's autocast (smp.step called inside one), or a served call's caller's."""
        stack = contextlib.ExitStack()
        for device_type, dtype in (self._autocast if autocast is None else autocast).items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        return stack

    # -- the model's forward and backward, called from the user's step function -----------------
    def model_forward(self, args, kwargs):
        task = current_task()
        if task is None:
            raise RuntimeError("smp: the DistributedModel was called outside an smp.step function (call it "
                               "inside the @smp.step function, which runs it once per microbatch)")
        k = task.model_calls
        task.model_calls += 1
        if self.pp_rank == self.root_owner:
            task.output_producer = None
            out = self.root(*args, **kwargs)
            skip = task.output_producer  # it has the output already, with its graph
            made = self.links.made_at()
            self._without_token(lambda: self._send_all(Message("out", {"mb": task.mb, "k": k}, out), skip=skip,
                                                        made_at=made))
            return out
        if k:  # the root's step function gets to this call only once it has its first answer
            self.flush_held_answer()
        out = self._wait(("out", task.mb, k), f"the model output of microbatch {task.mb} from pipeline rank "
                                              f"{self.root_owner} (the root's)")
        if isinstance(out, OwnOutputCall):
            out = self._serve_own_output(task, out)
        if not k:
            self.held_answers.picked_up((self._step, task.mb))
        return out

    def flush_held_answer(self) -> None:
        """The current microbatch's held answer (held_answers.py) leaves alone now: its step
        function is about to wait for something the root's step function does after its model
        call (a second model call, smp's own collectives and messages)."""
        task = current_task()
        if task is None or task.kind != "step" or not self.held_answers.holds((self._step, task.mb)):
            return
        self._without_token(lambda: self.held_answers.flush((self._step, task.mb), self.aborted))

    def model_backward(self, tensors, grads) -> None:
        task = current_task()
        if task is None:
            raise RuntimeError("smp: DistributedModel.backward was called outside an smp.step function")
        if task.backward_called:
            # The other partitions ran their part of the backward at the first call: a second
            # would reach this rank's part only, and train on gradients missing their share.
            raise RuntimeError("smp: model.backward was called twice in one microbatch of the step function; "
                               "add the losses and call model.backward once")
        task.backward_called = True
        self.backward_seen = True
        if not task.reached_backward:
            task.reached_backward = True
            with self._flow:
                self._at_backward += 1
                if self.pipeline == "simple":  # (only "simple" backwards wait for this count)
                    self._flow.notify_all()
        with self._lock:
            produced = self._output_frames.pop(task.mb, None)
        if self.pp_rank != self.root_owner and produced is None:
            return  # this rank's copy of the outputs has no graph: its part runs when asked
        task.phase = BACKWARD
        if self.pipeline == "simple":
            self._token.release()
            try:
                # all forwards before any backward
                with self._flow, self.stall.waiting("microbatch {}'s backward: every forward first", task.mb):
                    while self._at_backward < self.num_microbatches:
                        if self._error is not None:
                            raise self._error
                        self._flow.wait(0.5)
            finally:
                self._token.acquire(self._prio(task), self._label(task))
        else:
            # "interleaved": this backward goes on at once unless older work waits. Handing the
            # token over here let a later microbatch's forward run a layer before it (measured
            # on 2 x H200: on the last stage, that layer's activations at the peak, 120 MB at
            # m = 4, and the backward the first stage waits on started a layer later).
            if self._token.older_work_waits(self._prio(task)):
                self._token.release()
                self._token.acquire(self._prio(task), self._label(task))
            else:
                self._token.relabel(self._label(task))
        seeds, seed_grads = self._seeds(tensors, grads)
        if produced is not None:
            self._backward_from_output(produced[0], seeds, seed_grads)
            return
        # This microbatch's graph here is the step's own unless a call served here made part of
        # it (a module that keeps a tensor from one call for the next can join two graphs).
        self._backward(task.calls, seeds, seed_grads, last_use=task.mb not in self._served_mbs)
        task.calls = []

    def _seeds(self, tensors, grads):
        seeds, seed_grads = [], []
        for t, g in zip(tensors, grads):
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                continue
            if g is None:
                if t.numel() != 1:
                    raise RuntimeError("smp: model.backward(tensors) without gradients needs one-element tensors")
                # (One kernel for ones_like(t) * scale, the same value: both take the scale to
                # t's dtype through float.)
                g = torch.full_like(t, self.grad_scale)
            elif self.grad_scale != 1.0:
                g = g * self.grad_scale
            seeds.append(t)
            seed_grads.append(g)
        return seeds, seed_grads

    def _backward_from_output(self, call_id, seeds, seed_grads) -> None:
        """This rank served the root's last children, so its copy of the model output carries
        their graph, and its copy of the loss is the root's (every rank runs the step function on
        the same output values). Backward starts here, as torch's last pipeline stage does it,
        and the input gradients go to the caller unasked: no round trip through the root for the
        gradient of the output. The answer to the root's call, when held for it
        (held_answers.py), leaves in the same message."""
        key = (self._step, current_task().mb)
        held = self.held_answers.claim(key)
        merged = False
        if held is not None and held.made is not None:
            # (The copies were made on another thread, a forward ago.) Waited for before the
            # backward, so that the backward's point, which the merged message may be sent
            # from (_frame_backward), comes after them.
            cuda_streams.current(self.device.index).wait_event(held.made)
        try:
            try:
                dst, msg, made = self._frame_backward(call_id, seeds, seed_grads)
            except BaseException:
                if held is not None and self._error is None:  # the root still waits for it
                    try:
                        self._without_token(lambda: self._send_held_alone(held))
                    except BaseException:
                        pass  # the backward's error is what the step reports
                raise
            with self._lock:
                self.output_backwards += 1
            # (Always so, as _holds_answer holds only answers whose gradients go to the root;
            # otherwise the answer would leave first, alone.)
            if held is not None and dst == held.dst and msg.kind == "bwd_done":
                msg = Message("fwd_bwd_done", {"id": msg.fields["id"], "answer": held.meta},
                              (held.tensors, msg.body))
                self._send_in_turn(dst, msg, made)
                merged = True
            else:
                if held is not None:
                    self._without_token(lambda: self._send_held_alone(held))
                self._send_in_turn(dst, msg, made)
        finally:
            if held is not None:
                self.held_answers.sent(key, held, merged)
        self._check_grads_final()

    def _backward(self, calls: List[RemoteCall], seeds, seed_grads, last_use: bool = False) -> None:
        """Autograd from `seeds`, then from each call's inputs once the call's owner returns
        their gradients. Every traversal but the last keeps the graph (a skip connection can
        take two of them through the same nodes). `last_use`: no other traversal of this graph
        follows on this rank, so the last one frees each node's saved tensors as it goes, as a
        plain backward does (measured on an H200: the first stage kept a layer's activations
        more at its peak while the graph waited for the end of the microbatch)."""
        if seeds:
            torch.autograd.backward(seeds, seed_grads, retain_graph=bool(calls))
        for call in reversed(calls):
            if call.owner_starts_backward:
                in_grads = self._wait(("bwd_done", call.call_id), f"the backward of {call.what} on partition "
                                      f"{call.bwd_owner} (started there from its copy of the loss)")
                if in_grads is None:
                    raise StepFailed(
                        f"pipeline rank {call.bwd_owner} returned from the step function of microbatch "
                        f"{current_task().mb} without calling model.backward, but it holds the model's last "
                        "layers and starts the backward from its own copy of the loss; call model.backward "
                        "on every rank (or set SMDDP_SMP_OUTPUT_BACKWARD=0)")
            else:
                msg = Message("bwd", {"id": call.bwd_id, "mb": current_task().mb}, _grads_or_zeros(call.outputs))
                in_grads = self._request(call.bwd_owner, msg, ("bwd_done", call.call_id),
                                         f"the backward of {call.what}")
            pairs = [(t, g) for t, g in zip(call.inputs, in_grads) if g is not None]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs],
                                        retain_graph=not (last_use and call is calls[0]))

    # -- remote calls ---------------------------------------------------------------------------
    def call_remote(self, owner: int, path: str, span: Optional[Tuple[int, int]], args, kwargs,
                    produces_output: bool = False, chain: Sequence[Tuple[int, Tuple[int, int]]] = ()):
        """`produces_output`: the call's result is the root's output (the root Sequential's last
        children). For the step's first model call with gradients, the owner then keeps its
        result (with its graph) as its own copy of the model output and starts the backward from
        its own loss; the root waits for the input gradients instead of sending the output's,
        and its copy of the result carries no graph.

        `chain`: further runs of the same Sequential, (owner, span) each, that take this run's
        output in turn, all on other ranks than this one. Each hop sends its output straight to
        the next, and the last answers here; in the backward each hop sends its input gradients
        straight to the previous one, and the first answers here. Activations and gradients
        then cross each stage boundary once, as in torch's pipelines, instead of returning to
        the caller between stages (SMDDP_SMP_CHAIN_CALLS)."""
        task = current_task()
        if task is None:
            where = f"module '{path or '<root>'}'"
            raise RuntimeError(f"smp: {where} lives on partition {owner}; call the model inside an "
                               "smp.step function")
        call_id = (self.pp_rank, self._step, next(self._ids))
        what = f"module '{path or '<root>'}'" + (f" children {span[0]}..{span[1] - 1}" if span else "")
        owner_starts = (produces_output and self.output_backward and task.kind == "step" and
                        task.model_calls == 1 and torch.is_grad_enabled())
        chained = (" (chained on to " + ", ".join(f"children {a}..{b - 1} on partition {o}" for o, (a, b) in chain)
                   + ")" if chain else "")
        if owner_starts:
            task.output_producer = chain[-1][0] if chain else owner
        # The caller's autocast goes with the call: the step function may enter one itself.
        fields = {"id": call_id, "mb": task.mb, "path": path, "span": span, "grad": torch.is_grad_enabled(),
                  "output": owner_starts, "autocast": autocast_state()}
        if chain:
            fields["chain"] = [(o, tuple(sp)) for o, sp in chain]
        # A call after this microbatch's backward is not windowed: a frame it leaves on a stage
        # that had no backward of the microbatch yet would get none, and hold its place for good.
        if self.window_by_depth and self._windowed() and fields["grad"] and not task.backward_called:
            visits = self._visits_for(task, [owner, *(o for o, _ in chain)])
            if visits is not None:
                fields["visits"] = visits
        msg = Message("fwd", fields, (args, kwargs))
        waiter = self._expect(("fwd_done", call_id), f"the forward of {what} on partition {owner}{chained}")
        sent = self._send_in_turn(owner, msg)
        out, tensors, specs = self._wait_on(waiter)
        tail = (owner, call_id)
        if chain:  # the last hop answers with its output and where its backward is asked for
            out, tail = out
        inputs = [t for t in sent if t.requires_grad]
        leaves = []
        for t, s in zip(tensors, specs):
            if s.requires_grad:
                # When the owner starts the backward, nothing here ever seeds these outputs: as
                # leaves with a gradient they made this rank's copy of the loss keep its graph
                # alive (measured on an H200: 47 MB of float32 loss intermediates at the first
                # stage's peak) and run a backward of it that no gradient leaves.
                if not owner_starts:
                    t.requires_grad_(True)
                leaves.append(t)
        if leaves:
            # (Nor are they kept for the backward: the step function's copy of the output is
            # freed as soon as the step function drops it.)
            task.calls.append(RemoteCall(call_id, owner, what + chained, inputs, [] if owner_starts else leaves,
                                         owner_starts, *tail))
        return out

    def _request(self, owner: int, msg: Message, key, what: str):
        waiter = self._expect(key, what + f" on partition {owner}")
        self._send_in_turn(owner, msg)
        body, _, _ = self._wait_on(waiter)
        return body

    def _expect(self, key, what: str) -> Waiter:
        with self._lock:
            if key in self._waiters:  # delivered before we asked (the "out" broadcast)
                return self._waiters[key]
            w = self._waiters[key] = Waiter(what)
            if self._error is not None:
                w.fail(self._error)
            return w

    def _wait(self, key, what: str):
        body, _, _ = self._wait_on(self._expect(key, what))
        return body

    def yield_to_older_work(self) -> None:
        """Between the layers of a long local run: the holder steps aside when an older
        microbatch's work waits (its backward, under "interleaved"), instead of making it wait
        for the whole run."""
        if not self._token.anyone_waits():  # the common case between layers, cheaply
            return
        task = current_task()
        # Forward only: a recomputation inside backward (activation checkpointing) must not block.
        if task is None or task.phase != FORWARD or not self._token.older_work_waits(self._prio(task)):
            return
        self._token.release()
        self._token.acquire(self._prio(task), self._label(task))

    def run_local_children(self, run_id: tuple, children: List[torch.nn.Module], x):
        """`children` (consecutive children of a Sequential, all on this rank) applied in turn
        to `x`: replayed as CUDA graphs where stage_graphs.py can, else eagerly, stepping aside
        between children for older work."""
        # A Sequential nested in a run being warmed or captured runs plainly: stepping aside
        # would let another task compute into the capture.
        step_aside = not (self.graphs.enabled and self.graphs.inside_capture())

        def eager():
            out = x
            for n, child in enumerate(children):
                if n and step_aside:
                    self.yield_to_older_work()
                out = child(out)
            return out

        if not step_aside:
            return eager()
        task = current_task()
        if not self.graphs.enabled or task is None or task.phase != FORWARD or not self._graphable(run_id, children):
            return eager()
        return self.graphs.run(run_id, children, x, task.leases, eager)

    def _graphable(self, run_id: tuple, children: List[torch.nn.Module]) -> bool:
        """Whether a run is local through and through: a submodule on another partition would
        make a remote call inside the capture, and a checkpointed one recomputes in backward.
        Checked at each call: a module may be marked, or get hooks, after the partition (a
        replay would skip a hook's Python: it ran at the capture only)."""
        view = self.graphs.view(run_id, children)
        local = self._local_runs.get(run_id)
        if local is None or local[0] is not view:  # walked again: its modules changed
            # (A module added since the partition, a LoRA adapter say, runs where its parent does.)
            local = self._local_runs[run_id] = (view, not any(id(m) in self.remote_module_ids for m in view.subs))
        return local[1] and not view.hooked_or_checkpointed()

    def _send_in_turn(self, dst: int, msg: Message, made=None) -> List[torch.Tensor]:
        """Sends a message whose order the peer sees (it serves each kind in arrival order): the
        turn is taken while this task holds the token, the send made without it. `made`: the
        CUDA point its tensors were final at, when taken earlier (else now)."""
        turn = self.links.reserve(dst, msg.kind)
        used = False

        def send():
            nonlocal used
            used = True  # links.send uses the turn up, whatever happens
            return self.links.send(dst, msg, turn, made)
        try:
            if made is None:
                made = self.links.made_at()
            return self._without_token(send)
        finally:
            if not used:  # failed before the send: later sends to that peer must not wait for this turn
                self.links.pass_turn(dst, msg.kind, turn)

    def _without_token(self, fn):
        """Sends can wait on the network: other work of this rank runs meanwhile."""
        task = current_task()
        self._token.release()
        try:
            return fn()
        finally:
            self._token.acquire(self._prio(task), self._label(task))

    def _wait_on(self, waiter: Waiter):
        task = current_task()
        self._token.release()
        serving = task is not None and task.kind == "serve"
        if serving:  # the calls queued behind this one may be what the peer needs first
            self._serve_runner_waits(task.queue)
        body = None
        try:
            with self.stall.waiting("{}: {}", task or "a call", waiter.what):
                body, tensors, specs, ready = waiter.wait(self.aborted)
        finally:
            if serving:
                self._serve_runner_back(task.queue)
            if not isinstance(body, OwnOutputCall):  # (serving it takes the token itself)
                self._token.acquire(self._prio(task), self._label(task))
        take(tensors, ready)
        return body, tensors, specs

    # -- serving peers --------------------------------------------------------------------------
    def _receive_loop(self, src: int) -> None:
        while True:
            try:
                msg, tensors, specs, ready = self.links.receive(src)
                self.stall.heard()
            except QuietLink:
                if self._error is None:
                    continue  # this peer had nothing to say yet, not a fault
                return
            except BaseException as e:
                if self._error is None:
                    self._abort(StepFailed(self._describe(
                        f"the link from pipeline rank {src} (global rank {self.global_ranks[src]}) failed", e)))
                return
            if (msg.kind in ("fwd", "bwd", "fwd_done", "bwd_done", "fwd_bwd_done", "drop")
                    and msg.fields["id"][1] != self._step):
                self._abort(StepFailed(self._uneven_backward(
                    f"pipeline rank {src} sent pipeline rank {self.pp_rank} a '{msg.kind}' of step "
                    f"{msg.fields['id'][1]} after that step ended here")))
                return
            if msg.kind == "fwd":
                self._route_forward((src, msg, tensors, specs, ready))
            elif msg.kind == "bwd":
                self._queue_serve(msg.kind, (src, msg, tensors, specs, ready))
            elif msg.kind == "drop":  # served as backwards are, after those queued before it
                self._queue_serve("bwd", (src, msg, tensors, specs, ready))
            elif msg.kind in ("fwd_done", "bwd_done", "out"):
                key = ((msg.kind, msg.fields["mb"], msg.fields["k"]) if msg.kind == "out"
                       else (msg.kind, msg.fields["id"]))
                self._deliver(key, (msg.body, tensors, specs, ready))
            elif msg.kind == "fwd_bwd_done":  # a held answer with its call's input gradients
                copies, grads = msg.body
                answer_specs, *answer = pickle.loads(msg.fields["answer"])
                n = len(copies)
                answer_body = decode(*answer, copies).body
                self._deliver(("fwd_done", msg.fields["id"]), (answer_body, copies, answer_specs, ready))
                self._deliver(("bwd_done", msg.fields["id"]), (grads, tensors[n:], specs[n:], ready))
            elif msg.kind == "end":
                if src == self.root_owner:
                    self._root_ended = True
                return
            elif msg.kind == "abort":
                self._abort(StepFailed(msg.fields["why"]), from_peer=True)
                return

    def _deliver(self, key, value) -> None:
        with self._lock:
            w = self._waiter(key)
        w.set(value)

    def _waiter(self, key) -> Waiter:
        """The waiter for `key`, made if nobody asked for it yet (caller holds _lock)."""
        w = self._waiters.get(key)
        if w is None:
            w = self._waiters[key] = Waiter(str(key))
        return w

    def _inlines_output(self) -> bool:
        """Whether this step may hand output calls to step functions (_route_forward)."""
        return self.inline_output and self.pipeline == "interleaved" and self.held_answers.hold_s > 0

    def _route_forward(self, call) -> None:
        """A forward call from a peer goes to a serve runner, or, for the root's call that makes
        this rank's copy of the model output (the root Sequential's last children, whose owner
        starts the backward), to the step function thread that will wait for that output.

        That thread then serves the call itself and goes on to the loss and model.backward.
        Through a serve runner, the runner computed the output and woke the step function's
        thread, and that wake-up (0.3-0.45 ms a microbatch on 2 x H200, m = 16, while the GPU
        waited) sat on the last stage's critical path between its forward and backward.

        Only under "interleaved" with held answers, when the call is not a chain's hop: the
        answer then waits for the backward's message, so serving it usually sends nothing
        before the loss. Every forward call then takes a ticket in arrival order
        (ArrivalOrder), so calls still start computing in the order they arrived, whichever
        thread serves them, as one runner's queue kept them. A microbatch whose step function
        has already returned here (one that does not call the model on this rank) gets a
        runner, as before."""
        f = call[1].fields
        if not self._inlines_output():
            self._queue_serve("fwd", call)
            return
        own = f.get("output") and f.get("grad") and "parent" not in f and "chain" not in f
        with self._lock:  # (with the check of _ended_mbs, against _strand_own_output)
            ticket = self._arrivals.issue()
            if own and f["mb"] not in self._ended_mbs and self._error is None:
                self._waiter(("out", f["mb"], 0)).set((OwnOutputCall(call, ticket), [], [], None))
                return
        self._queue_serve("fwd", (*call, ticket))

    def _serve_own_output(self, task: Task, own: OwnOutputCall):
        """The step function's thread serves the call that makes its own model output
        (_route_forward) and returns that output, holding the token again. The forward runs
        under this thread's thread-local state, which is the root's at its model call (every
        rank runs the same step function); autocast's cache of cast weights is dropped after
        it, as a runner's was when its autocast ended, rather than kept until the step
        function ends."""
        try:
            local = self._serve(*own.call, ticket=own.ticket, inline=True)
        finally:
            _local.task = task
            torch.clear_autocast_cache()
            self._token.acquire(self._prio(task), self._label(task))
        if local is None:  # it failed, or the step was aborted before it ran: the step fails
            raise self._error if self._error is not None else StepFailed(
                f"pipeline rank {self.pp_rank}: serving the model output of microbatch {task.mb} failed")
        with self._lock:
            self.inline_output_serves += 1
        return local

    def _strand_own_output(self, mb: int) -> None:
        """A step function that returned without taking the call handed to it (it did not call
        the model here): this thread serves it now, before the microbatch's end is handled, so
        the root gets its answer, the next calls their turn, and a root that waits for this
        rank's backward the clear error of a skipped one (_run_microbatch)."""
        with self._lock:
            self._ended_mbs.add(mb)
            w = self._waiters.get(("out", mb, 0))
            left = w.unclaimed() if w is not None else None
        if left is not None and isinstance(left[0], OwnOutputCall):
            self._serve(*left[0].call, ticket=left[0].ticket, inline=True)
            _local.task = None

    def _queue_serve(self, queue: str, call) -> None:
        with self._lock:
            self._serve_queues[queue].append(call)
        self._ensure_serve_runner(queue)

    def _ensure_serve_runner(self, queue: str) -> None:
        """Starts a runner for `queue` when calls wait there and no runner is free to take
        them (a free runner takes them once done with the calls before them)."""
        with self._lock:
            if not self._serve_queues[queue] or self._serve_runners[queue] > 0:
                return
            self._serve_runners[queue] += 1
        self._spawn(self._run_serves, queue, name=f"smp-serve-{queue}", pool=self._serve_pool)

    def _run_serves(self, queue: str) -> None:
        while True:
            with self._lock:
                calls = self._serve_queues[queue]
                if self._error is not None:
                    calls.clear()  # the step failed: nobody waits for these
                if not calls:
                    self._serve_runners[queue] -= 1
                    return
                call = calls.popleft()
            self._serve(*call)
            call = None  # its tensors: not kept while this runner waits for the lock or leaves

    def _serve_runner_waits(self, queue: str) -> None:
        """A runner waits for a peer in the middle of a served call: the calls queued behind it
        get a runner of their own. (A step function serving its own output is no runner.)"""
        if queue not in self._serve_runners:
            return
        with self._lock:
            self._serve_runners[queue] -= 1
        self._ensure_serve_runner(queue)

    def _serve_runner_back(self, queue: str) -> None:
        """The runner that waited (_serve_runner_waits) takes calls again."""
        if queue in self._serve_runners:
            with self._lock:
                self._serve_runners[queue] += 1

    def _windowed(self) -> bool:
        return self.pipeline == "interleaved"

    def _window_limit(self, f) -> Optional[int]:
        """The window for a served forward (None: not bounded here). A rank-ordered Sequential
        root: the model's window, one more on the last stage for a call whose backward the root
        asks for (the last stage does not compute its loss: a second model call in the step
        function, say), which answers a round trip later. Any other layout: by depth."""
        if self.window is None:
            return self._depth_window(f) if self.window_by_depth else None
        last = self.pp_rank == self.pp_size - 1
        return self.window + (1 if last and self.output_backward and not f.get("output") else 0)

    def _depth_window(self, f) -> Optional[int]:
        """The window of a stage reached d-th by the microbatch's forward (the root's rank is
        0th), when the root is not a chain of stages in rank order (a custom forward): p - d, as
        1F1B's stage d, and one more, since the root computes the loss and the backward comes
        a round trip later. The caller lists the ranks in the order the microbatch reached
        them; a call that does not (its microbatch strayed from the first one's order: its
        place could then wait on a place that a later microbatch holds) is not bounded."""
        visits = f.get("visits")
        if not visits or self.pp_rank not in visits:
            return None
        return self.pp_size - visits.index(self.pp_rank) + 1

    def _visits_for(self, task: Task, owners: Sequence[int]) -> Optional[List[int]]:
        """The visiting order that a call of `task` to `owners` (in turn) carries, or None when
        it does not follow the reference order: the first microbatch's on the root this step.
        Only a call whose order agrees is windowed by depth, so that every windowed
        microbatch reaches the stages in one order and waits only for older ones."""
        if task.visits is None:
            return None
        for o in owners:
            if o not in task.visits:
                task.visits.append(o)
        with self._lock:
            ref = self._visit_reference
            if task.mb == 0:  # only the root's step functions follow their visits
                ref[len(ref):] = task.visits[len(ref):]
            if task.visits != ref[:len(task.visits)]:
                task.visits = None  # strayed: none of its later calls are windowed either
                return None
        return list(task.visits)

    def _enter_window(self, task: Task, limit: Optional[int], on_wait: Optional[Callable[[], None]] = None) -> bool:
        """A served forward of a microbatch new to this stage waits until fewer than `window`
        microbatches have frames here, as a stage of 1F1B holds only the microbatches between
        its forward and its backward (p - k on stage k, where the root's active_microbatches
        bounds every stage alike). Waiting microbatches enter in index order, and the token
        is held for the one entering until it asks (BatchNorm's statistics depend on the
        order). Calls queued behind a waiting one get a runner of their own: another call of
        a microbatch already here must not wait behind it. A microbatch whose step function
        ends here without a backward (evaluation) leaves the window then (_run_microbatch),
        and a forward of a microbatch whose backward ran here already takes no place (no
        backward would free it). Returns whether the call took a place. `on_wait`: run when the
        call starts waiting for a place (its turn among calls in arrival order is then over:
        waiters enter in microbatch order)."""
        mb = task.mb
        if limit is None:
            return False
        with self._flow:
            if mb in self._window_backed:
                return False
            if mb in self._window_live or (len(self._window_live) < limit and not self._window_waiting):
                self._window_take(mb)
                return True
            self._window_waiting[mb] += 1
        if on_wait is not None:
            on_wait()
        self._serve_runner_waits(task.queue)
        try:
            with self._flow, self.stall.waiting("{}: a place in this stage's window of {}", task, limit):
                while mb not in self._window_live and (len(self._window_live) >= limit
                                                       or mb != min(self._window_waiting)):
                    if self._error is not None:
                        raise self._error
                    self._flow.wait(0.5)
                self._window_take(mb)
                self._token.expect(self._prio(task))
            return True
        finally:
            with self._flow:
                self._window_waiting[mb] -= 1
                if self._window_waiting[mb] <= 0:
                    del self._window_waiting[mb]
                self._flow.notify_all()
            self._serve_runner_back(task.queue)

    def _window_take(self, mb: int) -> None:
        """One more call or frame of `mb` holds its place in the window (caller holds _flow)."""
        self._window_live[mb] = self._window_live.get(mb, 0) + 1

    def _window_done(self, mb: int, counted: bool = True, backward_ran: bool = False) -> None:
        """A served forward or a frame's backward of `mb` is over: its place goes once nothing
        of `mb` holds it. `counted`: the call or frame held a place; `backward_ran`: a frame's
        backward, after which forwards of `mb` here take no place."""
        with self._flow:
            if backward_ran:
                self._window_backed.add(mb)
            if not counted:
                return
            left = self._window_live.get(mb, 0) - 1
            if left > 0:
                self._window_live[mb] = left
            else:
                self._window_live.pop(mb, None)
                self._flow.notify_all()

    def _serve(self, src: int, msg: Message, tensors, specs, ready, ticket: Optional[int] = None,
               inline: bool = False):
        """Serves a peer's call. `ticket`: a forward call's place in arrival order (ArrivalOrder;
        None: the runner's queue alone orders the calls). `inline`: the step function's thread
        serves the call that makes its own model output (_route_forward); that output is
        returned instead of delivered (None if the call failed or the step was aborted)."""
        f = msg.fields
        if msg.kind == "drop":
            try:
                self._drop_frame(f["id"])
            except BaseException as e:
                self._abort(e if isinstance(e, StepFailed) else StepFailed(self._describe(
                    f"dropping a frame of microbatch {f['mb']}", e)))
            return
        _local.task = task = Task(f["mb"], FORWARD if msg.kind == "fwd" else BACKWARD, "serve",
                                  queue="inline" if inline else msg.kind)
        counted = False  # this call holds a place in the stage's window
        turn = None
        hold = False  # the answer waits for this microbatch's input gradients (held_answers.py)
        local = None
        made = None  # the CUDA point the answer's tensors are final at
        pass_turn = None if ticket is None else (lambda: self._arrivals.passed(ticket))
        try:
            take(tensors, ready)
            if ticket is not None:
                with self.stall.waiting("{}: the calls that arrived before it", task):
                    self._arrivals.wait_turn(ticket, self.aborted)
            if msg.kind == "fwd" and f["grad"] and self._windowed():
                counted = self._enter_window(task, self._window_limit(f), on_wait=pass_turn)
            with self._autocast_context(f.get("autocast")):
                self._token.acquire(self._prio(task), self._label(task))
                if pass_turn is not None:
                    pass_turn()
                if self._error is not None:  # (a call handed over before the step's abort arrived)
                    self._token.release()
                    raise self._error
                try:
                    if msg.kind == "fwd":
                        dst, kind, meta, out, local = self._serve_forward(f, msg.body, tensors, specs, task,
                                                                          counted)
                        if local is not None:  # this microbatch's step function computes next, here
                            self._token.expect(priority(FORWARD, f["mb"], self.pipeline))
                            hold = self._holds_answer(f)
                        # Forward answers leave in the order of the work that made them: a
                        # window wait can leave several runners, and the next stage serves
                        # forwards in arrival order (BatchNorm's statistics). (A held answer
                        # goes by key, with the gradients, and takes no turn.)
                        if not hold:
                            turn = self.links.reserve(dst, kind)
                    else:
                        dst, reply, made = self._serve_backward(f, msg.body)
                        (meta, out), local, kind = encode(reply)[:2], None, reply.kind
                    if made is None:  # (a backward with deferred weight passes took it already)
                        made = self.links.made_at()
                finally:
                    self._token.release()
            if local is not None:
                # This rank's own copy of the model output, with its graph, goes to its step
                # function before the answer leaves: the loss and the backward that start from
                # it are the last stage's next work, and waited for the answer's send (0.4-0.55
                # ms a microbatch on 2 x H200, m = 8). The answer's copies were made above, and
                # the step cannot end before the answer arrives (the root waits for it), so
                # nothing this runner still sends can follow this rank's "end".
                if hold:  # before the step function can reach model.backward, which claims it
                    self.held_answers.hold((self._step, f["mb"]), dst, meta, out, made)
                if not inline:
                    self._deliver(("out", f["mb"], 0), (local, [], [], None))
            # The drops go before the answer: once it is sent the step can end, and a drop
            # sent after this rank's "end" would reach its peer in the next step.
            for rank, drop in task.drops:
                self.links.send(rank, drop)
            if not hold:
                sending, turn = turn, None  # the send uses the turn up, whatever happens
                self.links.send_encoded_in_turn(dst, kind, meta, out, sending, made)
            if local is not None:
                self._skip_orphaned_backward(f)
        except BaseException as e:
            if turn is not None:  # reserved, never sent: later sends to that peer must not wait for it
                self.links.pass_turn(dst, kind, turn)
            what = f"module '{f.get('path') or '<root>'}'" if msg.kind == "fwd" else "a backward"
            self._abort(e if isinstance(e, StepFailed) else StepFailed(self._describe(
                f"{what} of microbatch {f['mb']} raised", e)))
            local = None
        finally:
            if pass_turn is not None:
                pass_turn()  # (failed before its turn: the abort ends the step for the later ones)
            if counted:
                self._window_done(f["mb"])  # this call's place; its frame, if any, keeps its own
            _local.task = None
        return local if inline else None

    def _holds_answer(self, f) -> bool:
        """Whether the answer to a served forward that made the model output here waits for
        its microbatch's input gradients: under "interleaved" (under "simple" every forward
        comes first, so it would wait the whole step), when the call was the root's own (not a
        chain's later hop, whose gradients go to the previous hop) and left a frame here, so
        this rank's model.backward will send the root those gradients."""
        if (self.held_answers.hold_s <= 0 or self.pipeline != "interleaved" or "parent" in f
                or self._error is not None):
            return False
        with self._lock:
            # (Not when its step function has returned here: nothing would claim it.)
            return self._output_frames.get(f["mb"], (None,))[0] == f["id"] and f["mb"] not in self._ended_mbs

    def _skip_orphaned_backward(self, f) -> None:
        """The call that made this rank's copy of the model output was served after its
        microbatch's step function returned here (one that does not call the model on this
        rank): no model.backward here will start that backward. Its frame goes, with its graph
        instances and its place in the window (a later microbatch waiting for that place would
        hang the step), and the caller gets the answer of a skipped backward, an error if it
        waits for it (_backward), as when the step function ends after the call was served
        (_run_microbatch). Before, the root waited for it forever."""
        with self._lock:
            if f["mb"] not in self._ended_mbs:
                return
            produced = self._output_frames.pop(f["mb"], None)
            frame = self._frames.pop(f["id"], None) if produced is not None else None
        if produced is None:
            return
        if frame is not None:
            self.graphs.release(frame.leases)
            if frame.windowed:
                self._window_done(frame.mb)
        caller, call_id = produced[1]
        self.links.send(caller, Message("bwd_done", {"id": call_id}, None))
        self._check_grads_final()  # (the frame no longer counts as a backward to come)

    def _serve_forward(self, f, body, tensors, specs, task: Task, counted: bool):
        """Runs a forward call for a peer; returns where its answer goes, the answer encoded,
        and this rank's own copy of the model output when it keeps one. The answer is the
        caller's result, or for a hop of a chain with hops left, the next hop's call."""
        inputs = []
        for t, s in zip(tensors, specs):
            if s.requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
                inputs.append(t)
        args, kwargs = body
        module = self.modules[f["path"]]
        with torch.set_grad_enabled(f["grad"]):
            if f["span"] is None:
                out = module(*args, **kwargs)
            else:
                a, b = f["span"]
                out = self.run_local_children((f["path"], a, b), list(module)[a:b], args[0])
        chain = f.get("chain") or []
        origin = tuple(f["reply"]) if "reply" in f else (f["id"][0], f["id"])  # (caller, its call id)
        if chain:
            (nxt, span), rest = chain[0], chain[1:]
            hop = {"id": (self.pp_rank, self._step, next(self._ids)), "mb": f["mb"], "path": f["path"], "span": span,
                   "grad": f["grad"], "output": f["output"], "reply": origin, "parent": f["id"],
                   "autocast": f["autocast"]}
            if rest:
                hop["chain"] = rest
            if "visits" in f:
                hop["visits"] = f["visits"]
            # The hops whose frames wait for this hop's backward (see _drop_frame). Not those
            # before a hop whose inputs need no gradient: no frame there waits on it.
            hop["upstream"] = (f.get("upstream", []) if inputs else []) + [(self.pp_rank, f["id"])]
            dst, answer = nxt, Message("fwd", hop, ((out,), {}))
            with self._lock:
                self.chained_hops += 1
        else:
            # A chain's last hop tells the caller where to send its outputs' gradients.
            body = (out, (self.pp_rank, f["id"])) if "reply" in f else out
            dst, answer = origin[0], Message("fwd_done", {"id": origin[1]}, body)
        meta, out_tensors, _ = encode(answer)
        outputs = [t for t in out_tensors if t.requires_grad]
        local = out if f.get("output") and not chain else None  # the caller sends this rank no copy of it
        if outputs:  # stored before the answer goes: the backward may follow at once
            windowed = False
            if counted:  # the call holds a place: its frame keeps one until its backward
                with self._flow:
                    # A forward after this microbatch's backward here (metrics with gradients
                    # on, say) leaves a frame no backward will free: not counted.
                    windowed = f["mb"] not in self._window_backed
                    if windowed:
                        self._window_take(f["mb"])
            with self._lock:
                self._frames[f["id"]] = ServedFrame(inputs, outputs, task.calls, task.leases, f.get("parent"), origin,
                                                    f["mb"], windowed)
                self._served_mbs.add(f["mb"])
                if local is not None:
                    self._output_frames[f["mb"]] = (f["id"], origin)
        else:
            self.graphs.release(task.leases)
            if inputs:
                # A hop whose inputs need a gradient but whose outputs carry none: no backward
                # will reach the hops before it, whose frames (and places in the window) would
                # otherwise stay until the step's end. They are told to drop them (_serve).
                task.drops = [(rank, Message("drop", {"id": call_id, "mb": f["mb"]}))
                              for rank, call_id in f.get("upstream", [])]
        if local is not None:
            # The step function here may change its output in place while the reply is still
            # being sent: the reply carries copies.
            out_tensors = [t.detach().clone() for t in out_tensors]
        return dst, answer.kind, meta, out_tensors, local

    def _drop_frame(self, call_id) -> None:
        """A later hop of a chain answered with outputs that carry no gradient, so the frame of
        the call `call_id` served here gets no backward: it goes now, with its graph instances
        and its place in the window (it held that place until the step's end, and a later
        microbatch waiting for it hung the step). The later hop tells every hop before it
        directly, so nothing is sent from here: a message sent after this rank's "end" would
        cross into the next step."""
        with self._lock:
            frame = self._frames.pop(call_id, None)
        if frame is None:  # this hop kept no frame (its own outputs carried no gradient)
            return
        self.graphs.release(frame.leases)
        self._window_done(frame.mb, counted=frame.windowed, backward_ran=True)
        self._check_grads_final()

    def _serve_backward(self, f, grads) -> Tuple[int, Message, Any]:
        answer = self._frame_backward(f["id"], None, list(grads))
        self._check_grads_final()
        return answer

    def _frame_backward(self, call_id, seeds, seed_grads) -> Tuple[int, Message, Any]:
        """The backward of a call this rank served, from `seeds` (None: the call's outputs);
        returns where the gradients of the call's inputs go, the message that carries them (the
        caller's answer, or the previous hop's backward request for a chain's later hop), and
        the CUDA point its tensors were final at when graphed weight passes were deferred
        (weight_split.py; else None: the sender takes the point). Counted as serving a backward
        meanwhile, so this rank's gradients are not taken for final."""
        with self._lock:
            frame = self._frames.pop(call_id)
            self._serving_backward += 1
        try:
            self._backward(frame.calls, frame.outputs if seeds is None else seeds, seed_grads)
            dst, msg = self._frame_answer(call_id, frame)
            made = None
            if self.graphs.weights_deferred():
                # The message leaves from here; the weight passes compute while it crosses,
                # before the release lets another microbatch's forward overwrite what they read.
                made = self.links.made_at()
                self.graphs.run_deferred_weights()
        finally:
            self.graphs.release(frame.leases)
            with self._lock:
                self._serving_backward -= 1
            if self._windowed():
                self._window_done(frame.mb, counted=frame.windowed, backward_ran=True)
        return dst, msg, made

    @staticmethod
    def _frame_answer(call_id, frame) -> Tuple[int, Message]:
        if frame.parent is None or not frame.inputs:
            # The first hop, or a hop whose inputs need no gradient (so the hops before it kept
            # no frame): the caller's answer.
            caller, origin_id = frame.origin
            return caller, Message("bwd_done", {"id": origin_id}, [t.grad for t in frame.inputs])
        # The previous hop's outputs are this frame's inputs, in order; it seeds its backward
        # with all of them.
        return call_id[0], Message("bwd", {"id": frame.parent, "mb": current_task().mb}, _grads_or_zeros(frame.inputs))

    # -- failure ----------------------------------------------------------------------------------
    @staticmethod
    def _uneven_backward(what: str) -> str:
        return (f"smp: {what}: model.backward was called on some pipeline ranks but not on others in "
                "the same step; call model.backward on every rank (each runs the step function on the "
                "same output)")

    def _describe(self, what: str, e: BaseException) -> str:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
        return (f"pipeline rank {self.pp_rank} (global rank {self.global_ranks[self.pp_rank]}): {what}: "
                f"{type(e).__name__}: {e}\n{tb}")

    def _abort(self, error: BaseException, from_peer: bool = False) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            first_send = not self._abort_sent
            self._abort_sent = True
            waiters = list(self._waiters.values())
        for w in waiters:
            w.fail(self._error)
        self._token.wake()
        self._arrivals.wake()
        with self._flow:
            self._flow.notify_all()
            self._a_microbatch_ended.set()
            for turn in self._first_turns.values():
                turn.set()
        if first_send:
            why = str(self._error)
            for p in range(self.pp_size):
                if p != self.pp_rank:
                    try:
                        self.links.send(p, Message("abort", {"why": why}))
                    except BaseException:
                        pass  # that peer is gone: its own link failure ends its step

    def _send_held_alone(self, held: HeldAnswer) -> bool:
        """Sends a held answer by itself; False when its step failed or is over (nothing of a
        step may leave after it: the peers stopped reading at its abort or "end")."""
        if self._error is not None or held.key[0] != self._step:
            return False
        self.links.send_encoded(held.dst, held.meta, held.tensors, held.made)
        return True

    def _held_answer_failed(self, e: BaseException) -> None:
        self._abort(StepFailed(self._describe("sending a held answer to the root", e)))

    def _send_all(self, msg: Message, skip: Optional[int] = None, made_at=None) -> None:
        for p in range(self.pp_size):
            if p != self.pp_rank and p != skip:
                self.links.send(p, msg, made_at=made_at)
