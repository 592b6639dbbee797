"""The digits example written against the older API (library v1.3 and before).

Same training as train_digits.py, but through `smdistributed.dataparallel.torch.distributed`
and the library's own `DistributedDataParallel`, whose gradient reduction runs in the native
engine (fused, overlapped with backward). These entry points are deprecated and warn once.

    smddprun -np 2 python examples/pytorch/train_digits_legacy.py
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

# SageMaker data parallel: Import the library PyTorch API
import smdistributed.dataparallel.torch.distributed as dist

# SageMaker data parallel: Import the library PyTorch DDP
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

# SageMaker data parallel: Initialize the library
dist.init_process_group()


class Net(nn.Module):
    """The MNIST example's network, sized for 8x8 digit images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def load_digits_dataset(train: bool):
    """scikit-learn's 1,797 8x8 digits, split 80/20, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    split = int(len(labels) * 0.8)
    sl = slice(0, split) if train else slice(split, None)
    return torch.utils.data.TensorDataset(images[sl], labels[sl])


def train(model, device, train_loader, optimizer, epoch):
    model.train()
    total_loss, samples, start = 0.0, 0, time.perf_counter()
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(data)
        samples += len(data)
    # Average the epoch's loss and add up throughput over all ranks for the progress line.
    stats = torch.tensor([total_loss, samples], dtype=torch.float64)
    dist.all_reduce(stats)
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: loss {stats[0] / stats[1]:.4f}, {stats[1] / elapsed:,.0f} samples/s "
              f"on {dist.get_world_size()} processes", flush=True)


def test(model, device, test_loader):
    model.eval()
    correct, count = 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            correct += (model(data).argmax(dim=1) == target).sum().item()
            count += len(data)
    accuracy = correct / count
    print(f"test accuracy {accuracy:.4f} ({correct}/{count})", flush=True)
    return accuracy


def main():
    parser = argparse.ArgumentParser(description="smddp digits example")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--save-model", default="digits_cnn.pt", help="checkpoint path ('' to skip)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    # SageMaker data parallel: Scale batch size by world size
    batch_size = args.batch_size // dist.get_world_size()
    batch_size = max(batch_size, 1)

    # Prepare dataset
    train_dataset = load_digits_dataset(train=True)
    test_dataset = load_digits_dataset(train=False)

    # SageMaker data parallel: Set num_replicas and rank in DistributedSampler
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=batch_size, sampler=train_sampler)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=256)

    # SageMaker data parallel: Pin each GPU to a single library process.
    if torch.cuda.is_available():
        local_rank = dist.get_local_rank()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    # SageMaker data parallel: Wrap the PyTorch model with the library's DDP
    model = DDP(Net().to(device))

    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(model, device, train_loader, optimizer, epoch)
        if dist.get_rank() == 0:
            test(model, device, test_loader)
        scheduler.step()

    # SageMaker data parallel: Save model on the leader node (rank 0).
    if dist.get_rank() == 0 and args.save_model:
        torch.save(model.module.state_dict(), args.save_model)
        print(f"saved {args.save_model}", flush=True)


if __name__ == "__main__":
    main()
