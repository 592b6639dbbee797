"""The last stage's answers to the root, held to leave with the input gradients
(SMDDP_SMP_HOLD_ANSWER_MS).

When the last stage starts the backward from its own copy of the loss (runtime's output
backward), each microbatch costs it two messages to the root: the answer to the root's call
(the root's copy of the model output, for its step function) and, a loss and a backward
later, the call's input gradients. Held until the backward, the answer rides in the
gradients' message: one header, one NCCL group and one receive on the root instead of two,
and one wake-up of the root's step function instead of two.

Holding is only safe while the last stage's step function goes from the model call straight
to model.backward. The root's step function waits for the answer, so anything the last stage
waits for in between that the root's step function would do after its model call (a second
model call, a collective or a message with the root) would deadlock. The runtime sends the
answer alone at once where it can see such a wait coming (a second model call, the step
function ending without a backward); for what it cannot see (a collective in user code), a
flusher thread sends each answer alone once it has been held SMDDP_SMP_HOLD_ANSWER_MS, so such
a step function costs that time per microbatch instead of hanging.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional

import torch

log = logging.getLogger("smdistributed.modelparallel")


@dataclass
class HeldAnswer:
    dst: int  # the pipeline rank it answers (the root)
    meta: bytes  # the answer, encoded (wire.encode); its tensors below
    tensors: List[torch.Tensor]  # copies of the model output, made before the answer was held
    made: Any  # a CUDA event after the copies (Links.made_at), or None
    key: Hashable  # (step, microbatch)
    deadline: float  # time.monotonic() after which the flusher sends it alone
    claimed: bool = False  # someone is sending it (alone or with the gradients)
    sent: threading.Event = field(default_factory=threading.Event)


class HeldAnswers:
    """Answers held per key (step, microbatch), each claimed once: by the backward that sends
    it with the gradients, by the step function's thread that sends it alone, or by the
    flusher at its deadline."""

    def __init__(self, hold_s: float, send_alone: Callable[[HeldAnswer], None],
                 on_error: Callable[[BaseException], None], device: torch.device):
        self.hold_s = hold_s
        self._send_alone = send_alone
        self._on_error = on_error
        self._device = device
        self._cv = threading.Condition()
        self._held: Dict[Hashable, HeldAnswer] = {}
        self._flusher: Optional[threading.Thread] = None
        self._flusher_idle = False  # waiting with nothing held: a new answer must wake it
        self.merged = 0  # answers that left with their gradients, ever
        self.late = 0  # answers the flusher sent alone at their deadline, ever
        self._warned = False

    def hold(self, key: Hashable, dst: int, meta: bytes, tensors: List[torch.Tensor], made: Any) -> None:
        answer = HeldAnswer(dst, meta, tensors, made, key, time.monotonic() + self.hold_s)
        with self._cv:
            self._held[key] = answer
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_due, name="smp-held-answers", daemon=True)
                self._flusher.start()
            elif self._flusher_idle:  # (else it wakes by the earliest deadline, which is older)
                self._cv.notify()

    def holds(self, key: Hashable) -> bool:
        with self._cv:
            return key in self._held

    def picked_up(self, key: Hashable) -> None:
        """The step function has its copy of the output: the hold time counts from now (the
        wait for the compute token before it is not the step function's doing). Deadlines
        only move later, so the flusher, which wakes by the earliest, needs no notice."""
        with self._cv:
            answer = self._held.get(key)
            if answer is not None:
                answer.deadline = max(answer.deadline, time.monotonic() + self.hold_s)

    def claim(self, key: Hashable) -> Optional[HeldAnswer]:
        """The answer held under `key` for the caller to send, or None (none held, or another
        thread is sending it)."""
        with self._cv:
            answer = self._held.get(key)
            if answer is None or answer.claimed:
                return None
            answer.claimed = True
            return answer

    def sent(self, key: Hashable, answer: HeldAnswer, merged: bool = False) -> None:
        """A claimed answer has left (or its send failed, and the step with it)."""
        with self._cv:
            self._held.pop(key, None)
            if merged:
                self.merged += 1
        answer.sent.set()

    def flush(self, key: Hashable, aborted: Callable[[], Optional[BaseException]]) -> None:
        """Sends the answer held under `key` alone now, or waits while the flusher sends it:
        the caller is about to wait for the root, or to end the microbatch (after which
        nothing of it may leave: the step's "end" could overtake it)."""
        with self._cv:
            answer = self._held.get(key)
            mine = answer is not None and not answer.claimed
            if mine:
                answer.claimed = True
        if mine:  # (a failed step's is not sent: _send_alone refuses it)
            try:
                self._send_alone(answer)
            finally:
                self.sent(key, answer)
            return
        while answer is not None and not answer.sent.wait(0.5):
            if aborted() is not None:
                return

    def drop_step(self, step: int) -> None:
        """At the end of a step, once its tasks are joined: forgets what a failed step still
        holds (an answer held by a runner after the abort reached its microbatch), and waits
        while the flusher finishes a send it began, so nothing of the step leaves later."""
        with self._cv:
            left = [a for k, a in self._held.items() if k[0] == step]
            for a in left:
                if not a.claimed:
                    a.claimed = True
                    self._held.pop(a.key, None)
                    a.sent.set()
        for a in left:
            a.sent.wait(30)

    def _flush_due(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            with self._cv:
                while True:
                    due = min(((a.deadline, k) for k, a in self._held.items() if not a.claimed), default=None)
                    now = time.monotonic()
                    if due is not None and due[0] <= now:
                        key = due[1]
                        answer = self._held[key]
                        answer.claimed = True
                        break
                    self._flusher_idle = due is None
                    self._cv.wait(None if due is None else due[0] - now)
                self._flusher_idle = False
            try:
                if self._send_alone(answer):
                    self.late += 1
                    if not self._warned:
                        self._warned = True
                        log.warning("smp: the last stage's step function spent over %.0f ms between the model "
                                    "call and model.backward, so the root's copy of the output left alone, without "
                                    "the input gradients. A slow loss does that now and then; if the step function "
                                    "waits on the root there (a collective, say), every microbatch pays this wait: "
                                    "set SMDDP_SMP_HOLD_ANSWER_MS=0", self.hold_s * 1e3)
            except BaseException as e:  # the link failed: the step fails on every rank
                try:
                    self._on_error(e)
                except BaseException:  # (this thread must live on: later answers need it)
                    log.exception("smp: reporting a failed send of a held answer failed")
            finally:
                self.sent(key, answer)
            answer = None
