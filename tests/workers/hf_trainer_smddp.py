"""Hugging Face Trainer with SageMaker's data-parallel switch (SM_FRAMEWORK_PARAMS with
sagemaker_distributed_dataparallel_enabled): transformers and accelerate import torch_smddp,
init "smddp" and read SMDATAPARALLEL_LOCAL_RANK themselves. A small GPT-2 trains for a few
steps; every rank must end with the same weights as one process training on the global batches.
Prints "HF TRAINER OK"."""
import json
import os

os.environ.setdefault("SM_FRAMEWORK_PARAMS", json.dumps({"sagemaker_distributed_dataparallel_enabled": True}))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import is_sagemaker_dp_enabled  # noqa: E402

STEPS, PER_RANK, SEQ, LR = 4, 2, 32, 1e-3


def model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 256, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class InOrder(Trainer):
    """Batches in dataset order, so the one-process reference can take the same global batches
    (accelerate gives rank r batches r, r + world, ... of PER_RANK samples)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main():
    assert is_sagemaker_dp_enabled(), "transformers does not see the SageMaker data-parallel switch"
    world = int(os.environ["SMDATAPARALLEL_SIZE"]) if "SMDATAPARALLEL_SIZE" in os.environ else int(
        os.environ["WORLD_SIZE"])
    data = Tokens(STEPS * PER_RANK * world)
    args = TrainingArguments(output_dir=os.environ.get("HF_OUT", "/tmp/hf_smddp"), per_device_train_batch_size=PER_RANK,
                             max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                             dataloader_drop_last=True, disable_tqdm=True, max_grad_norm=0.0)
    m = model()
    trainer = InOrder(model=m, args=args, train_dataset=data)
    trainer.train()
    import torch.distributed as dist

    assert dist.get_backend() == "smddp", dist.get_backend()
    rank = dist.get_rank()
    # One process on the global batches: step s takes samples s*world*PER_RANK onwards.
    ref = model().to(m.device)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        batch = data.ids[step * world * PER_RANK:(step + 1) * world * PER_RANK].to(m.device)
        opt.zero_grad()
        ref(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    worst = max((a.detach().float() - b.detach().float()).abs().max().item()
                for a, b in zip(m.parameters(), ref.parameters()))
    print(f"rank {rank}: largest difference from one process {worst:.3g}", flush=True)
    assert worst < 1e-4, worst
    print(f"rank {rank}: HF TRAINER OK", flush=True)


if __name__ == "__main__":
    main()
