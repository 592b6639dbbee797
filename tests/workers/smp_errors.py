"""Misuse and failures of smdistributed.modelparallel.torch: each case prints (or reports,
report.py) what every rank saw. argv: case (misuse | bad_config | rank_dies | rank_stops |
rank_dies_with_replicas | replica_skips_a_step | quiet_links | slow_middle_stage | backward_on_one_rank |
backward_not_on_root | backward_twice | message_stops_halfway | rank0_dies_before_init)."""
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp
from report import report

CASE = sys.argv[1]


def expect(error_type, fragment, fn):
    try:
        fn()
    except error_type as e:
        assert fragment in str(e), f"expected {fragment!r} in: {e}"
        return str(e)
    raise AssertionError(f"no {error_type.__name__} ({fragment!r})")


class Dies(nn.Module):
    """Ends its process (exit) or stops it (SIGSTOP: alive, sockets open, silent) in the middle
    of a step's forward when asked to."""

    def __init__(self, how: str = "exit"):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.armed = False
        self.how = how

    def forward(self, x):
        if self.armed:
            if self.how == "stop":
                report("fault", at=time.time())
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)  # the stop reaches this thread some instructions later
            os._exit(3)
        return self.fc(x)



@smp.step
def train_step(model, x, y):
    """The training step every case runs: a cross-entropy loss and its backward."""
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def misuse():
    smp.init({"partitions": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0})
    with smp.partition(1):
        head = nn.Linear(8, 2)
    expect(ValueError, "must be an integer in 0..1", lambda: smp.partition(2).__enter__())
    model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), head))
    expect(RuntimeError, "already wrapped", lambda: smp.DistributedModel(nn.Linear(2, 2)))
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    expect(RuntimeError, "outside an smp.step", lambda: model(x))
    expect(RuntimeError, "outside an smp.step", lambda: model.backward(torch.ones(())))

    # A batch the microbatches do not divide: refused on every rank before any work starts.
    expect(ValueError, "which 4 microbatches do not divide", lambda: train_step(model, x[:6], y[:6]))
    loss = train_step(model, x, y).reduce_mean()
    assert torch.isfinite(loss)
    expect(RuntimeError, "outside an smp.step", lambda: model(x))
    expect(RuntimeError, "already wrapped", lambda: smp.DistributedModel(nn.Linear(2, 2)))

    # The user's step function raising on one rank, in one microbatch: every rank raises it.
    @smp.step
    def faulty_step(model, x, y):
        out = model(x)
        if smp.pp_rank() == 1 and x[0, 0].item() == x0:
            raise ValueError("bad sample in the user's code")
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        return loss

    x0 = x[4, 0].item()  # microbatch 2 (4 microbatches of 2 samples)
    msg = expect(smp.StepFailed, "bad sample in the user's code", lambda: faulty_step(model, x, y))
    assert "pipeline rank 1" in msg and "microbatch 2" in msg, msg
    expect(smp.StepFailed, "an earlier step failed", lambda: train_step(model, x, y))
    print("MISUSE OK", flush=True)


def bad_config():
    msg = expect(smp.ConfigError, "unknown configuration key 'partitons'", lambda: smp.init({"partitons": 2}))
    print("REFUSED:", msg, flush=True)


def rank_dies(how: str = "exit", replicas: bool = False):
    """Global rank 1 dies (or stops) mid-step. pp=3: it is the middle stage. replicas (pp=2 x
    dp=2): it is the first replica's last stage; its pipeline peer fails the step, and the other
    replica's ranks, which meet it and its peer in the gradient reduction, fail too."""
    if replicas:
        smp.init({"partitions": 2, "microbatches": 2, "ddp": True, "auto_partition": False, "default_partition": 0})
        with smp.partition(1):
            dies = Dies(how)
            head = nn.Linear(8, 2)
    else:
        smp.init({"partitions": 3, "microbatches": 2, "auto_partition": False, "default_partition": 0})
        with smp.partition(1):
            dies = Dies(how)
        with smp.partition(2):
            head = nn.Linear(8, 2)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), dies, head))

    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    train_step(model, x, y)
    dies.armed = smp.rank() == 1
    t0 = time.monotonic()
    try:
        train_step(model, x, y)
    except Exception as e:  # the test checks that it is StepFailed
        report("step_failed", after_s=time.monotonic() - t0, kind=type(e).__name__,
               message=str(e).replace("\n", " "))
        print("STEP FAILED:", str(e).splitlines()[0], flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)


def rank0_dies_before_init():
    """Rank 0, which serves torch's store, exits before smp.init: the others must fail within
    SMDDP_TIMEOUT, not wait torch's 30 minutes for a store that never comes."""
    if int(os.environ["SMDDP_RANK"]) == 0:
        os._exit(3)
    t0 = time.monotonic()
    try:
        smp.init({"partitions": 3, "microbatches": 2})
    except Exception as e:
        report("init_failed", after_s=time.monotonic() - t0, kind=type(e).__name__, message=str(e)[:500])
        os._exit(0)
    print("NO ERROR", flush=True)


def replica_skips_a_step():
    """pp=2 x dp=2: the second replica's batch of step 2 is one the microbatches do not divide;
    its ranks catch the error and go on to step 3, while the first replica runs step 2. The
    replicas must not average step 3's gradients with step 2's: every rank fails instead."""
    smp.init({"partitions": 2, "microbatches": 4, "ddp": True, "auto_partition": False, "default_partition": 0})
    with smp.partition(1):
        head = nn.Linear(8, 2)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), head))

    @smp.step
    def eval_step(model, x):
        return model(x)

    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    try:
        for step in (1, 2, 3):
            if step == 2 and smp.dp_rank() == 0:  # evaluation on one replica only, which is allowed
                with torch.no_grad():
                    eval_step(model, x)
                eval_step(model, x)  # grad enabled, no backward
            n = 6 if step == 2 and smp.dp_rank() == 1 else 8
            try:
                train_step(model, x[:n], y[:n])
            except ValueError as e:
                assert "microbatches do not divide" in str(e), e
                report("skipped", step=step)
    except smp.StepFailed as e:
        report("step_failed", step=step, message=str(e).replace("\n", " "))
        print("STEP FAILED:", str(e).splitlines()[0], flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(float(os.environ["SMP_TEST_SLOW_S"]))
        return self.fc(x)


def quiet_links(slow_on: int = 0):
    """Links that carry nothing for longer than SMDDP_TIMEOUT (every link waits while
    partition 0 runs a long forward) are quiet, not failures: the step completes.
    slow_on=1: the middle stage runs the long forward, and the root waits for its answer with
    nothing arriving (the test sets SMDDP_STALL_WARNING below the wait: a stall report)."""
    smp.init({"partitions": 3, "microbatches": 1, "auto_partition": False, "default_partition": 0})
    with smp.partition(slow_on):
        slow = Slow()
    with smp.partition(1):
        middle = nn.Linear(8, 8)
    with smp.partition(2):
        head = nn.Linear(8, 2)
    model = smp.DistributedModel(nn.Sequential(slow, middle, head))

    loss = train_step(model, torch.randn(4, 8), torch.randint(0, 2, (4,))).reduce_mean()
    assert torch.isfinite(loss)
    print("QUIET OK", flush=True)


def two_stage_classifier():
    """A Sequential root whose last child lives on partition 1, so the last stage starts the
    backward from its own loss."""
    smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    with smp.partition(1):
        head = nn.Linear(8, 2)
    return smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), head))


def backward_on_one_rank():
    """The last stage starts the backward from its own loss (a Sequential root whose last
    children live on partition 1): an evaluation step without backward still works, and a step
    function that calls model.backward on rank 0 only gets an error naming the requirement on
    both ranks, not a hang."""
    model = two_stage_classifier()

    # An evaluation step with gradients enabled and no backward anywhere works (the last
    # stage's kept output is dropped), and so does training afterwards.
    @smp.step
    def eval_step(model, x, y):
        return F.cross_entropy(model(x), y)

    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    assert torch.isfinite(eval_step(model, x, y).reduce_mean())

    assert torch.isfinite(train_step(model, x, y).reduce_mean())

    @smp.step
    def rank0_backward(model, x, y):
        loss = F.cross_entropy(model(x), y)
        if smp.pp_rank() == 0:
            model.backward(loss)
        return loss

    expect(smp.StepFailed, "call model.backward on every rank",
           lambda: rank0_backward(model, torch.randn(4, 8), torch.randint(0, 2, (4,))))
    print("BACKWARD ON ONE RANK OK", flush=True)


def model_on_one_rank():
    """A step function that calls the model (and model.backward) on the root only, while the
    last stage holds the model's last layers and starts the backward from its own loss: an
    error naming the requirement on both ranks, not a hang. The last stage's step function
    returns before or after the root's call reaches it; either way the call is served there
    and the root learns that no backward will start."""
    model = two_stage_classifier()
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    assert torch.isfinite(train_step(model, x, y).reduce_mean())

    @smp.step
    def root_only(model, x, y):
        if smp.pp_rank() == 0:
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            return loss
        return torch.zeros(())

    expect(smp.StepFailed, "call model.backward on every rank", lambda: root_only(model, x, y))
    print("MODEL ON ONE RANK OK", flush=True)


def forward_after_backward():
    """A step function that calls the model again after model.backward, gradients on (metrics,
    say): the second call's frame on the last stage never has a backward. With 2 microbatches
    and the last stage's window of one microbatch, it must not keep the next microbatch out
    (it hung there), and training goes on."""
    model = two_stage_classifier()

    @smp.step
    def train_then_forward(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss, model(x).sum()

    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for _ in range(2):
        loss, extra = train_then_forward(model, x, y)
        assert torch.isfinite(loss.reduce_mean()) and torch.isfinite(extra.reduce_mean())
    assert torch.isfinite(train_step(model, x, y).reduce_mean())
    print("FORWARD AFTER BACKWARD OK", flush=True)


def forward_after_backward_new_stage():
    """A custom forward (windowed by depth): the step function's call after model.backward takes
    a branch to a partition the microbatch had not reached, gradients on. That stage never
    runs a backward of the microbatch, so the call must not take a place in its window (with
    4 microbatches against its window of 2, the third hung there)."""
    smp.init({"partitions": 3, "microbatches": 4, "auto_partition": False, "default_partition": 0})

    class Fork(nn.Module):
        def __init__(self):
            super().__init__()
            with smp.partition(1):
                self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)
            with smp.partition(2):
                self.probe = nn.Linear(8, 2)

        def forward(self, x, extra=False):
            h = torch.relu(self.body(x))
            return self.probe(h) if extra else self.head(h)

    model = smp.DistributedModel(Fork())

    @smp.step
    def train_then_probe(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss, model(x, extra=True).sum()

    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    for _ in range(2):
        loss, extra = train_then_probe(model, x, y)
        assert torch.isfinite(loss.reduce_mean()) and torch.isfinite(extra.reduce_mean())
    print("FORWARD AFTER BACKWARD NEW STAGE OK", flush=True)


def backward_not_on_root():
    """Three stages, the root's Sequential chained over partitions 1 and 2 (the last starts the
    backward from its own loss): a step function that calls model.backward everywhere but on
    the root sends the root input gradients it never asks for. That is an error naming the
    requirement on every rank, at that step on the root and at the next on the others (they
    had finished the step; the root's abort reaches them there), never gradients that only
    some ranks applied or a message taken for an answer of the next step."""
    smp.init({"partitions": 3, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    with smp.partition(1):
        mid = nn.Linear(8, 8)
    with smp.partition(2):
        head = nn.Linear(8, 2)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), mid, nn.ReLU(), head))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))

    @smp.step
    def not_on_root(model, x, y):
        loss = F.cross_entropy(model(x), y)
        if smp.pp_rank() != 0:
            model.backward(loss)
        return loss

    assert torch.isfinite(train_step(model, x, y).reduce_mean())
    messages = []
    for step in (not_on_root, train_step):
        try:
            step(model, x, y)
        except smp.StepFailed as e:
            messages.append(str(e))
    assert messages and "model.backward was called on some pipeline ranks but not on others" in messages[0], messages
    print("BACKWARD NOT ON ROOT OK", flush=True)


def backward_twice():
    """model.backward twice in one microbatch: the second call would reach this rank's part of
    the model only (the other partitions ran theirs at the first), so it is an error on every
    rank, not gradients that miss the other partitions' share of the second loss."""
    model = two_stage_classifier()

    @smp.step
    def two_losses(model, x, y):
        out = model(x)
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        model.backward(out.pow(2).mean())
        return loss

    expect(smp.StepFailed, "model.backward was called twice",
           lambda: two_losses(model, torch.randn(4, 8), torch.randint(0, 2, (4,))))
    print("BACKWARD TWICE OK", flush=True)


def message_stops_halfway():
    """Between two pipeline ranks' links (SMDDP_TIMEOUT=2, set by the test): a wait for a
    message that has not begun is a quiet link, but a message whose header came and whose
    tensors stop coming is a fault. (Both used to read as quiet, and the receiver then took
    the rest of the broken message for the start of the next.)"""
    import torch.distributed as dist
    from smdistributed.modelparallel.torch import wire
    from smdistributed.modelparallel.torch.state import state
    from smdistributed.modelparallel.torch.wire import Links, Message, QuietLink, encode

    smp.init({"partitions": 2, "microbatches": 1})
    smp.mp_barrier()  # the link's group is up on both ranks before either goes quiet
    links = Links(state.pp_group, list(state.topo.pp_group), smp.pp_rank(), {}, torch.device("cpu"))
    pause = 3.0  # longer than SMDDP_TIMEOUT
    if smp.pp_rank() == 1:
        time.sleep(pause)
        # A message's header (its meta fits), then nothing more for a while.
        meta, tensors, _ = encode(Message("fwd_done", {"id": (1, 1, 0)}, torch.ones(4)))
        header, inline, packed = wire.header_for(meta)  # (not packed: the tensor follows on its own)
        assert inline == len(meta) and not packed
        dist.send(header, state.topo.pp_group[0], group=state.pp_group, tag=wire.TAG_HEADER)
        time.sleep(pause)
        try:
            dist.send(tensors[0], state.topo.pp_group[0], group=state.pp_group, tag=wire.TAG_PAYLOAD)
        except RuntimeError:
            pass  # nobody reads it any more: failing here is right too
    else:
        expect(QuietLink, "made no progress", lambda: links.receive(1))
        try:
            links.receive(1)
        except QuietLink as e:
            raise AssertionError(f"a message stopped halfway was taken for a quiet link: {e}")
        except RuntimeError as e:
            assert "made no progress" in str(e), e
        else:
            raise AssertionError("a message whose tensors never came was received")
    print("HALFWAY OK", flush=True)


{"misuse": misuse, "bad_config": bad_config, "rank_dies": rank_dies, "rank_stops": lambda: rank_dies("stop"),
 "rank_dies_with_replicas": lambda: rank_dies(replicas=True), "replica_skips_a_step": replica_skips_a_step,
 "quiet_links": quiet_links, "slow_middle_stage": lambda: quiet_links(slow_on=1),
 "backward_on_one_rank": backward_on_one_rank, "model_on_one_rank": model_on_one_rank,
 "forward_after_backward": forward_after_backward,
 "forward_after_backward_new_stage": forward_after_backward_new_stage,
 "backward_not_on_root": backward_not_on_root, "backward_twice": backward_twice,
 "message_stops_halfway": message_stops_halfway, "rank0_dies_before_init": rank0_dies_before_init}[CASE]()
