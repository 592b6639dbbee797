"""The SageMaker data parallel PyTorch example, on scikit-learn's bundled digits (no download).

Shaped exactly like the library's documented MNIST script: the smddp backend, torch DDP,
a DistributedSampler, the batch size divided by the world size, rank-0 evaluation and
checkpoint. Runs on CPU, or one GPU per process where there are GPUs.

    smddprun -np 2 python examples/pytorch/train_digits.py          # or torchrun --nproc_per_node 2
"""
import argparse
import os

import torch
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

from digits import Net, load_digits_dataset, test, train

# SageMaker data parallel: Import the library PyTorch API
import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

# SageMaker data parallel: Import PyTorch's distributed API
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# SageMaker data parallel: Initialize the process group
dist.init_process_group(backend="smddp")


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
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    # SageMaker data parallel: Wrap the PyTorch model with DDP
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
