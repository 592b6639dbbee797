"""Horovod's pytorch_mnist.py, with only its import changed (and digits instead of MNIST).

    smddprun -np 2 python examples/pytorch/horovod_digits.py

`import horovod.torch as hvd` becomes `import smdistributed.dataparallel.torch as hvd`; the
rest is Horovod's example: DistributedSampler by hvd.size()/hvd.rank(), learning rate scaled
by hvd.size(), parameters and optimizer state broadcast from rank 0, DistributedOptimizer
with named parameters, metrics averaged with hvd.allreduce.
"""
import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import smdistributed.dataparallel.torch as hvd
from digits import Net, load_digits_dataset


def main():
    parser = argparse.ArgumentParser(description="Horovod-style digits example")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size for training")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    parser.add_argument("--no-cuda", action="store_true", default=False)
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    train_dataset = load_digits_dataset(train=True)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = load_digits_dataset(train=False)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.batch_size, sampler=test_sampler)

    model = Net()
    if args.cuda:
        model.cuda()
    # Horovod: scale learning rate by the number of GPUs.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    def metric_average(val, name):
        return hvd.allreduce(torch.tensor(val), name=name).item()

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_accuracy += output.argmax(dim=1).eq(target).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100.0 * test_accuracy:.1f}%", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
