"""The one change the seed-002 scripts need: scikit-learn's 8x8 digits instead of an MNIST
download (same shape of task: 10 classes, one channel). Imported by both scripts."""
import torch


def digits_dataset():
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    return torch.utils.data.TensorDataset(images, labels)


def shard(dataset, index, count):
    """What the seed's SplitDataset(partitions={i: 1/dp_size}).select(i) does."""
    n = len(dataset) // count
    return torch.utils.data.Subset(dataset, range(index * n, (index + 1) * n))
