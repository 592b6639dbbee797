"""PyTorch Lightning's DDPStrategy with process_group_backend="smddp" (the ranks started by
smddprun or torchrun, which Lightning detects): training equals one process training on the
global batches. Prints LIGHTNING OK."""
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

STEPS_DATA, PER_RANK, EPOCHS, LR = 64, 8, 2, 0.1


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS_DATA, 8, generator=g), torch.randn(STEPS_DATA, 1, generator=g)


def main():
    x, y = data()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Each rank its own interleaved share, in a loader this test controls (no sampler swap).
    mine = torch.utils.data.TensorDataset(x[rank::world], y[rank::world])
    loader = torch.utils.data.DataLoader(mine, batch_size=PER_RANK, shuffle=False)
    model = Regression()
    # SMDDP_TEST_DEVICE=cuda: one GPU per rank (Lightning then passes device_id to
    # init_process_group and asks the group for its CUDA Backend).
    accelerator = "gpu" if os.environ.get("SMDDP_TEST_DEVICE") == "cuda" else "cpu"
    trainer = pl.Trainer(strategy=DDPStrategy(process_group_backend="smddp"), accelerator=accelerator, devices=world,
                         max_epochs=EPOCHS, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, loader)
    assert torch.distributed.get_backend() == "smddp"
    # One process: the same model on the global batches (both ranks' batches, in sampler order).
    ref = Regression()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for start in range(0, STEPS_DATA, PER_RANK * world):
            idx = torch.arange(start, start + PER_RANK * world)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ref.net(x[idx]), y[idx]).backward()
            opt.step()
    for (name, a), b in zip(model.net.named_parameters(), ref.net.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    print(f"rank {trainer.global_rank}: LIGHTNING OK", flush=True)


if __name__ == "__main__":
    sys.exit(main())
