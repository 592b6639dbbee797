"""Pipeline training equivalence: N steps through smp on this world against one process
training the same model on the same batches. Prints one JSON line per rank.

argv: model (seq | seqparts | seqfrozen | skip | tied | gpt | enc | resid), mode (auto | manual), pipeline
(simple | interleaved), partitions, microbatches, steps.
"""
import contextlib
import gc
import os
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from report import report

import smdistributed.modelparallel.torch as smp

MODEL, MODE, PIPELINE = sys.argv[1], sys.argv[2], sys.argv[3]
PARTS, MBS, STEPS = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
ACTIVE = int(sys.argv[7]) if len(sys.argv) > 7 else None  # active_microbatches (default partitions + 2)
BATCH, WIDTH = 24, 16
DEVICE = os.environ.get("SMDDP_TEST_DEVICE", "cpu")
# bf16 autocast around the reference and the step ("1"), or entered inside the step function ("inside")
AUTOCAST = os.environ.get("SMP_TEST_AUTOCAST") in ("1", "inside")
AUTOCAST_INSIDE = os.environ.get("SMP_TEST_AUTOCAST") == "inside"
# The step function calls the model a second time before model.backward (its result times 0
# joins the loss, which leaves the loss and the gradients as they are).
SECOND_CALL = os.environ.get("SMP_TEST_SECOND_CALL") == "1"
# The step function waits between its model call and model.backward until the root's step
# function has passed its model call (through the c10d store: a wait that smp cannot see).
WAIT_ON_ROOT = os.environ.get("SMP_TEST_WAIT_ON_ROOT") == "1"


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.fc = nn.Linear(w, w)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class SkipNet(nn.Module):
    """Not a plain sequence: a skip connection from the first partition to the last, a module
    called twice (on both sides of another partition's work), dict outputs, kwargs."""

    def __init__(self, parts):
        super().__init__()
        last = parts - 1
        nested = os.environ.get("SMP_TEST_NESTED") == "1"  # the gate made in a context inside another
        with smp.partition(0):
            self.embed = nn.Linear(8, WIDTH)
            self.shared = Block(WIDTH)
            if nested:
                with smp.partition(last):  # the innermost context wins
                    self.gate = nn.Linear(WIDTH, WIDTH)
        with smp.partition(min(1, last)):
            self.middle = nn.Sequential(Block(WIDTH), Block(WIDTH))
        with smp.partition(last):
            self.head = nn.Linear(WIDTH, 4)
            if not nested:
                self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, scale=1.0):
        h = self.embed(x)
        skip = h
        h = self.shared(h)
        h = self.middle(h)
        h = self.shared(h) * torch.sigmoid(self.gate(skip))
        return {"logits": self.head(h) * scale, "hidden": h}


class ResidNet(nn.Module):
    """A residual around a remote block: the first partition's Sequential output feeds both
    the remote block and the sum after it, so its backward runs twice, once per segment
    (the graphed run's second backward replay must find its activations intact)."""

    def __init__(self, parts):
        super().__init__()
        with smp.partition(0):
            self.pre = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
            self.head = nn.Linear(WIDTH, 4)
        with smp.partition(parts - 1):
            self.remote = Block(WIDTH)

    def forward(self, x):
        h = self.pre(x)
        return self.head(h + self.remote(h))


def bounce_net(parts):
    """A Sequential that passes through every partition in turn and comes back to the first:
    its runs on partitions 1.. are one chained call (each hop sends straight to the next) whose
    result returns to partition 0, so the backward is asked of the chain's last hop."""
    last = parts - 1
    with smp.partition(0):
        first, head = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 4)
    middle = []
    for p in (1, min(2, last), last):
        with smp.partition(p):
            middle.append(Block(WIDTH))
    return nn.Sequential(first, *middle, head)


def frozen_net(parts):
    """bounce_net with its first layer and partition 1's block frozen (fine-tuning's frozen
    lower layers): the chain's first hop gets and gives no gradient, so the next hop's inputs
    need none and it answers the caller itself in the backward."""
    net = bounce_net(parts)
    for module in (net[0], net[1]):
        module.requires_grad_(False)
    return net


class Cut(nn.Module):
    """A layer whose output carries no gradient (a stop-gradient inside the model)."""

    def __init__(self, w):
        super().__init__()
        self.fc = nn.Linear(w, w)

    def forward(self, x):
        return torch.tanh(self.fc(x)).detach()


def cut_net(parts):
    """A Sequential through partitions 1 and 2 and back to 0, cut on partition 2: the chain's
    second hop takes an input that needs a gradient and answers with one that does not, so the
    first hop's frame never gets a backward (it is told to drop it instead)."""
    with smp.partition(0):
        first, head = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 4)
    with smp.partition(1):
        middle = Block(WIDTH)
    with smp.partition(min(2, parts - 1)):
        cut = Cut(WIDTH)
    return nn.Sequential(first, middle, cut, head)


VOCAB, SEQ = 12, 6


class TiedLM(nn.Module):
    """Tied weights across partitions: the output projection is the input embedding's weight
    (a language model's usual tie), the embedding on the first partition and the projection
    on the last; the body between them."""

    def __init__(self, parts):
        super().__init__()
        last = parts - 1
        with smp.partition(0):
            self.embed = nn.Embedding(VOCAB, WIDTH)
        with smp.partition(min(1, last)):
            self.body = nn.Sequential(Block(WIDTH), Block(WIDTH))
        with smp.partition(last):
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens).mean(dim=1)))


class GptBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MiniGpt(nn.Module):
    """A GPT-2-shaped decoder: token and position embeddings, pre-norm blocks with causal
    self-attention called from a Python loop over a ModuleList, a final norm, and the output
    projection tied to the token embedding (as GPT-2's lm_head is)."""

    def __init__(self, layers=4, d=WIDTH, heads=2, context=SEQ):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(GptBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def encoder_stack():
    """A Sequential of transformer encoder layers (attention, layer norm, GELU-free MLP) between
    a projection into 4 tokens and a head: what the pipeline benchmark runs, made small."""
    layers = [nn.Linear(8, 4 * WIDTH), nn.Unflatten(1, (4, WIDTH))]
    layers += [nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(4)]
    layers += [nn.Flatten(1), nn.Linear(4 * WIDTH, 4)]
    return nn.Sequential(*layers)


def build():
    torch.manual_seed(1234)
    if MODEL == "enc":
        return encoder_stack()
    if MODEL == "resid":
        return ResidNet(PARTS)
    if MODEL == "bounce":
        return bounce_net(PARTS)
    if MODEL == "frozen":
        return frozen_net(PARTS)
    if MODEL == "cut":
        return cut_net(PARTS)
    if MODEL == "tied":
        return TiedLM(PARTS)
    if MODEL == "gpt":
        return MiniGpt()
    if MODEL == "seq":  # manual: no smp.partition context, so all of it on the default partition
        return nn.Sequential(*seq_layers())
    if MODEL == "seqreuse":  # each stage's run calls one Linear twice (a graphed run must train it once)
        layers = []
        for p in range(PARTS):
            with smp.partition(p):
                shared = nn.Linear(WIDTH, WIDTH)
                layers += [nn.Linear(8 if p == 0 else WIDTH, WIDTH), nn.ReLU(), shared, nn.Tanh(), shared, nn.ReLU()]
                if p == PARTS - 1:
                    layers.append(nn.Linear(WIDTH, 4))
        return nn.Sequential(*layers)
    if MODEL in ("seqparts", "seqfrozen"):  # the same layers split by hand, an even run in each smp.partition
        layers = []
        for p in range(PARTS):
            with smp.partition(p):
                part = seq_layers(p, PARTS)
            if MODEL == "seqfrozen" and p == 0:  # fine-tuning's frozen lower layers: the next
                for layer in part:  # stage's input needs no gradient, so it returns none
                    layer.requires_grad_(False)
            layers += part
        return nn.Sequential(*layers)
    return SkipNet(PARTS)


def seq_layers(part: int = 0, parts: int = 1):
    """Part `part` of `parts` (even runs, the last shorter) of a stack of Linear and ReLU layers."""
    makers = [lambda: nn.Linear(8, WIDTH), nn.ReLU]
    for _ in range(5):
        makers += [lambda: nn.Linear(WIDTH, WIDTH), nn.ReLU]
    makers += [lambda: nn.Linear(WIDTH, 4)]
    per = -(-len(makers) // parts)
    return [make() for make in makers[part * per:(part + 1) * per]]


def optimizer(params):
    """SGD with momentum, or with SMP_TEST_OPTIMIZER=lamb smp's FusedLamb, clipping by a norm
    the gradients exceed (every stage must clip by the whole model's norm), or =novograd smp's
    FusedNovoGrad with weight decay."""
    if os.environ.get("SMP_TEST_OPTIMIZER") == "lamb":
        return smp.optimizers.FusedLamb(params, lr=0.05, max_grad_norm=0.05)
    if os.environ.get("SMP_TEST_OPTIMIZER") == "novograd":
        return smp.optimizers.FusedNovoGrad(params, lr=0.05, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_of(out, target):
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batches(dp_rank, dp_size):
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(STEPS):
        if MODEL == "tied":
            x = torch.randint(0, VOCAB, (BATCH * dp_size, 5), generator=g)
            y = torch.randint(0, VOCAB, (BATCH * dp_size,), generator=g)
        elif MODEL == "gpt":  # next-token prediction: the targets are the tokens shifted by one
            tokens = torch.randint(0, VOCAB, (BATCH * dp_size, SEQ + 1), generator=g)
            x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        else:
            x = torch.randn(BATCH * dp_size, 8, generator=g)
            y = torch.randint(0, 4, (BATCH * dp_size,), generator=g)
        out.append((x, y))
    return out


def main():
    cfg = {"partitions": PARTS, "microbatches": MBS, "pipeline": PIPELINE,
           "auto_partition": MODE == "auto", "ddp": True}
    if MODE == "manual":  # the root module and anything outside smp.partition contexts
        cfg["default_partition"] = int(os.environ.get("SMP_TEST_DEFAULT_PARTITION", "0"))
    if ACTIVE is not None:
        cfg["active_microbatches"] = ACTIVE
    smp.init(cfg)
    dev = torch.device("cpu")
    if DEVICE == "cuda":
        # On a one-GPU machine both stages share it (their link goes through host memory).
        torch.cuda.set_device(smp.local_rank() % torch.cuda.device_count())
        dev = torch.device("cuda")
    data = [(x.to(dev), y.to(dev)) for x, y in batches(smp.dp_rank(), smp.dp_size())]

    # The reference: one process, the whole batch of every replica, plain autograd.
    ref = build().to(dev)
    ref_opt = optimizer(ref.parameters())
    ref_losses = []
    autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=AUTOCAST)  # noqa: E731
    for x, y in data:
        ref_opt.zero_grad()
        with autocast():
            loss = loss_of(ref(x, scale=0.5) if MODEL == "skip" else ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    net = build()
    if os.environ.get("SMP_TEST_MOVED_BEFORE_WRAP") == "1":
        net.to(dev)  # as many scripts do; the partition must take the other stages' parts off this GPU
    forward_threads = set()  # threads that ran a module's forward on this rank
    if os.environ.get("SMP_TEST_COUNT_THREADS") == "1":  # (a module with hooks is never graphed)
        for m in net.modules():
            m.register_forward_pre_hook(lambda mod, args: forward_threads.add(threading.get_ident()))
    model = smp.DistributedModel(net)
    sent_order = hold_back_answers(float(os.environ.get("SMP_TEST_SLOW_ANSWERS", "0")))
    if os.environ.get("SMP_TEST_CHECKPOINTING"):
        # Recomputed in backward: a Sequential (each child), a module called twice, one layer.
        if MODEL == "skip":
            smp.set_activation_checkpointing(model.module.middle)
            smp.set_activation_checkpointing(model.module.shared)
        else:
            smp.set_activation_checkpointing(model.module[2])
    opt = smp.DistributedOptimizer(optimizer(model.parameters()))
    loss_graphs = []  # per microbatch: whether this rank's copy of the loss carries a graph

    @smp.step
    def train_step(model, x, y):
        # (an autocast entered with enabled=False would turn the one around the step off)
        with torch.autocast(dev.type, dtype=torch.bfloat16) if AUTOCAST_INSIDE else contextlib.nullcontext():
            out = model(x, scale=0.5) if MODEL == "skip" else model(x)
            if WAIT_ON_ROOT:
                wait_on_root(model)
            logits = out["logits"] if isinstance(out, dict) else out
            assert logits.dtype == (torch.bfloat16 if AUTOCAST else torch.float32), logits.dtype
            loss = loss_of(out, y)
            if SECOND_CALL:
                loss = loss + 0 * model(x).sum()
        loss_graphs.append(loss.requires_grad)
        model.backward(loss)
        return loss

    losses = []
    for x, y in data:
        shard = slice(smp.dp_rank() * BATCH, (smp.dp_rank() + 1) * BATCH)
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=AUTOCAST and not AUTOCAST_INSIDE):
            loss_mb = train_step(model, x[shard], y[shard])
        loss = loss_mb.reduce_mean()
        # The reference loss is over every replica's samples: average the replicas' losses.
        if smp.dp_size() > 1:
            t = loss.detach().clone()
            torch.distributed.all_reduce(t, group=smp.get_dp_process_group())
            loss = t / smp.dp_size()
        opt.step()
        losses.append(loss.item())

    eval_step_s = None
    if os.environ.get("SMP_TEST_EVAL_STEP") == "1":  # gradients on, no model.backward (metrics, say)
        @smp.step
        def eval_step(model, x, y):
            return loss_of(model(x), y)

        began = time.time()
        x, y = data[0]
        shard = slice(smp.dp_rank() * BATCH, (smp.dp_rank() + 1) * BATCH)
        eval_loss = eval_step(model, x[shard], y[shard]).reduce_mean().item()
        eval_step_s = time.time() - began
        assert eval_loss == eval_loss, "the evaluation step's loss is NaN"

    full = model.state_dict()
    ref_sd = {k: v.cpu() for k, v in ref.state_dict().items()}
    worst = max(((full[k] - ref_sd[k]).abs().max() / (ref_sd[k].abs().max() + 1e-12)).item() for k in ref_sd)
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    local = sorted(n for n, _ in model.local_named_parameters())
    others_on = sorted({str(p.device) for n, p in model.module.named_parameters() if n not in local})
    del loss_mb, loss  # the last step's StepOutput and loss, which this script held
    report("trained", rank=smp.rank(), pp_rank=smp.pp_rank(), dp_rank=smp.dp_rank(), param_rel_err=worst,
           loss_rel_err=loss_err, keys_match=sorted(full) == sorted(ref_sd), local=local, losses=losses,
           output_backwards=model._runtime.output_backwards, chained_hops=model._runtime.chained_hops,
           loss_graphs=sum(loss_graphs), kept_after_steps=step_tensors_alive(),
           forward_threads=len(forward_threads), graphs=dict(model._runtime.graphs.counters),
           graph_layout=model._runtime.graphs.layout(), others_on=others_on, link_ctas=link_ctas(),
           gradients_before_answer=gradients_before_answer(sent_order),
           merged_answers=model._runtime.held_answers.merged, late_answers=model._runtime.held_answers.late,
           inline_output_serves=model._runtime.inline_output_serves, eval_step_s=eval_step_s,
           host_staged_links=len(smp_state().host_staged_links))


_root_passes = {}  # waits so far on this rank, per store key (wait_on_root)
_root_passes_lock = threading.Lock()  # (each microbatch's step function runs on a thread of its own)


def wait_on_root(model):
    """The root's step function counts its model calls in the c10d store; the others' wait
    until it has made as many as they have waited for (per data-parallel replica)."""
    store = torch.distributed.distributed_c10d._get_default_store()
    key = f"smp_test_root_passed_{smp.dp_rank()}"
    if smp.pp_rank() == model._runtime.root_owner:
        store.add(key, 1)
        return
    with _root_passes_lock:
        n = _root_passes[key] = _root_passes.get(key, 0) + 1
    deadline = time.time() + 60
    while store.add(key, 0) < n:
        assert time.time() < deadline, "the root's step function never passed its model call"
        time.sleep(0.002)


def hold_back_answers(delay_s: float):
    """SMP_TEST_SLOW_ANSWERS=S: this rank's forward answers ("fwd_done") leave S seconds late
    (the transport is the real one; only the send starts later). Returns the kinds this rank
    sent, in order, with their call ids, for gradients_before_answer."""
    from smdistributed.modelparallel.torch import wire
    order = []
    if delay_s <= 0:
        return order
    send_encoded_in_turn, send = wire.Links.send_encoded_in_turn, wire.Links.send

    def late_answer(self, dst, kind, meta, tensors, turn, made_at=None):
        if kind == "fwd_done":
            time.sleep(delay_s)
            order.append(("fwd_done", wire.pickle.loads(meta)[2]["id"]))
        return send_encoded_in_turn(self, dst, kind, meta, tensors, turn, made_at)

    def noted(self, dst, msg, turn=None, made_at=None):
        if msg.kind == "bwd_done":
            order.append(("bwd_done", msg.fields["id"]))
        return send(self, dst, msg, turn, made_at)

    wire.Links.send_encoded_in_turn, wire.Links.send = late_answer, noted
    return order


def gradients_before_answer(order) -> int:
    """How many calls' input gradients this rank sent before their forward answer."""
    answered, early = set(), 0
    for kind, call_id in order:
        if kind == "fwd_done":
            answered.add(call_id)
        elif call_id not in answered:
            early += 1
    return early


def smp_state():
    from smdistributed.modelparallel.torch.state import state
    return state


def link_ctas():
    """The thread-block cap of each CUDA link's NCCL communicator that this rank used
    (SMDDP_SMP_P2P_MAX_CTAS): {"a->b": cap}, 0 where NCCL chose."""
    from smdistributed.dataparallel.torch.process_group import smddp_group
    from smdistributed.modelparallel.torch.state import state
    caps = {}
    for (a, b), group in state.cuda_links.items():
        gpu = smddp_group(group)._cuda_collectives
        if gpu is not None:
            caps[f"{a}->{b}"] = gpu.nccl.max_ctas
    return caps


def step_tensors_alive():
    """Tensors of a finished step that nothing of the user's holds (a microbatch's inputs,
    outputs or gradients, with their autograd graphs): there must be none between steps."""
    gc.collect()
    kept = []
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not isinstance(o, nn.Parameter) and (
                o.grad_fn is not None or o.requires_grad):
            kept.append(f"{tuple(o.shape)} {type(o.grad_fn).__name__}")
    return kept


if __name__ == "__main__":
    main()
