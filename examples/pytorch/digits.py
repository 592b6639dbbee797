"""The digits model, data and train/test loops shared by the two PyTorch examples."""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


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
