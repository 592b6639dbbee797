"""Hugging Face transformers' GPT2LMHeadModel (a small random configuration) under smp with
automatic partitioning, against one process training the same model on the same batches.

argv: partitions, pipeline (simple | interleaved), steps. Reports "trained" as
smp_pipeline.py does. GPT-2's lm_head is tied to its token embedding, and its blocks sit in
a ModuleList that GPT2Model's forward loops over.
"""
import sys

import torch
import torch.nn.functional as F
from report import report
from transformers import GPT2Config, GPT2LMHeadModel

import smdistributed.modelparallel.torch as smp

PARTS, PIPELINE, STEPS = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
BATCH, SEQ, VOCAB = 8, 12, 64
# SGD, not Adam: the key part of GPT-2's c_attn bias has a gradient of exactly zero in theory
# (softmax ignores a shift shared by every key), so what is computed there is rounding noise,
# which Adam scales up to steps of the learning rate's size, differently for a batch split in
# microbatches than for a whole one. SGD compares every parameter to 1e-6.
OPT = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731


def build():
    torch.manual_seed(7)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def main():
    smp.init({"partitions": PARTS, "microbatches": 2, "pipeline": PIPELINE, "ddp": True})
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH * smp.dp_size(), SEQ + 1), generator=g)
        data.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    ref = build()
    ref_opt = OPT(ref.parameters())
    ref_losses = []
    for x, y in data:
        ref_opt.zero_grad()
        loss = loss_of(ref(input_ids=x).logits, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(OPT(model.parameters()))

    @smp.step
    def train_step(model, x, y):
        loss = loss_of(model(input_ids=x).logits, y)
        model.backward(loss)
        return loss

    losses = []
    for x, y in data:
        shard = slice(smp.dp_rank() * BATCH, (smp.dp_rank() + 1) * BATCH)
        opt.zero_grad()
        loss = train_step(model, x[shard], y[shard]).reduce_mean()
        if smp.dp_size() > 1:
            t = loss.detach().clone()
            torch.distributed.all_reduce(t, group=smp.get_dp_process_group())
            loss = t / smp.dp_size()
        opt.step()
        losses.append(loss.item())

    full = model.state_dict()
    ref_sd = ref.state_dict()
    worst = max(((full[k] - ref_sd[k]).abs().max() / (ref_sd[k].abs().max() + 1e-12)).item()
                for k in ref_sd if ref_sd[k].is_floating_point())
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    report("trained", rank=smp.rank(), pp_rank=smp.pp_rank(), dp_rank=smp.dp_rank(), param_rel_err=worst,
           loss_rel_err=loss_err, keys_match=sorted(full) == sorted(ref_sd),
           local=sorted(n for n, _ in model.local_named_parameters()), losses=losses)


if __name__ == "__main__":
    main()
