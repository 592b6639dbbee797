"""smp.save / smp.load round trips. argv: directory, phase, partitions[, processes] (more
processes than partitions: ddp, every replica on the same batches).

first:          4 steps; after step 2, dp_rank 0 saves a partial checkpoint (local state dicts)
                and a full one (gathered state dicts); prints the losses of steps 3-4 and
                saves the final full model state.
resume_partial: a differently initialised model loads the partial checkpoint, runs steps 3-4.
resume_full:    the same from the full checkpoint.
ckpt_partial, ckpt_full: the same through smp.resume_from_checkpoint, from the folder that
                smp.save_checkpoint wrote after step 2 (newest partial; a full one by tag).
ckpt_wrong_parts: resume a partial checkpoint with another number of partitions (an error).
load_wrong_parts: the same through smp.load + load_state_dict (ranks with a file refuse its
                partition count; a rank without one names the missing file).
The test compares the resumed runs' losses and final parameters with the first run's,
bitwise, and loads the full checkpoint into the plain nn.Module. SMP_TEST_TIED=1: a model
whose embedding (first partition) is also its output projection (last partition).
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from report import report

import smdistributed.modelparallel.torch as smp

DIR, PHASE, PARTS = sys.argv[1], sys.argv[2], int(sys.argv[3])
PROCS = int(sys.argv[4]) if len(sys.argv) > 4 else PARTS


TIED = os.environ.get("SMP_TEST_TIED") == "1"


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens).mean(dim=1)))


def build(seed):
    torch.manual_seed(seed)
    if TIED:
        return TiedModel()
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def main():
    smp.init({"partitions": PARTS, "microbatches": 2, "pipeline": "simple", "ddp": PROCS > PARTS})
    dev = torch.device("cpu")
    if os.environ.get("SMDDP_TEST_DEVICE") == "cuda":  # a GPU per rank, or shared by ranks when fewer
        dev = torch.device("cuda", smp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    model = smp.DistributedModel(build(1 if PHASE == "first" else 2))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    ckpt, full = os.path.join(DIR, "checkpoint.pt"), os.path.join(DIR, "full.pt")

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 4, (16, 3), generator=g) if TIED else torch.randn(16, 8, generator=g),
                torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
    first = 0
    folder = os.path.join(DIR, "ckpt")
    if PHASE == "ckpt_wrong_parts":
        try:
            smp.resume_from_checkpoint(folder)
        except RuntimeError as e:
            print("REFUSED:", e, flush=True)
            return
        raise AssertionError("a checkpoint of another partition count was loaded")
    if PHASE == "load_wrong_parts":
        try:
            state = smp.load(ckpt, partial=True)
            model.load_state_dict(state["model_state_dict"])
        except (RuntimeError, FileNotFoundError) as e:
            print("REFUSED:", e, flush=True)
            return
        raise AssertionError("a partial state of another partition count was loaded")
    if PHASE.startswith("ckpt_"):
        full_ckpt = PHASE == "ckpt_full"
        content = smp.resume_from_checkpoint(folder, tag="full2" if full_ckpt else None, partial=not full_ckpt)
        assert content == {"step": 2}, content
        first = 2
    elif PHASE != "first":
        partial = PHASE == "resume_partial"
        state = smp.load(ckpt if partial else full, partial=partial)
        model.load_state_dict(state["model_state_dict"])
        opt.load_state_dict(state["optimizer_state_dict"])
        first = 2
    losses = []
    for i in range(first, 4):
        opt.zero_grad()
        loss = train_step(model, *(t.to(dev) for t in batches[i])).reduce_mean()
        opt.step()
        losses.append(loss.item())
        if PHASE == "first" and i == 1 and smp.dp_rank() == 0:
            smp.save({"model_state_dict": model.local_state_dict(), "optimizer_state_dict": opt.local_state_dict()},
                     ckpt, partial=True)
            smp.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict()},
                     full, partial=False)
        if PHASE == "first" and i == 1:  # every rank: the full save gathers
            smp.save_checkpoint(folder, "full2", partial=False, model=model, optimizer=opt, user_content={"step": 2})
            smp.save_checkpoint(folder, "step2", partial=True, model=model, optimizer=opt, user_content={"step": 2})
            if smp.rank() == 0:  # a later save that crashed before it completed
                os.makedirs(os.path.join(folder, "step3_partial"))
                with open(os.path.join(folder, "step3_partial", "model_0.pt"), "wb") as f:
                    f.write(b"truncat")
    if PHASE == "first":
        losses = losses[2:]
    final = model.state_dict()
    if smp.pp_rank() == 0:
        torch.save(final, os.path.join(DIR, f"final_{PHASE}_{PARTS}x{PROCS}.pt"))
    report("trained", rank=smp.rank(), losses=losses, local=sorted(n for n, _ in model.local_named_parameters()))


main()
