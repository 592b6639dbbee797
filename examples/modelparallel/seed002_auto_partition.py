"""Seed 002's auto-partition script, run as written except for the data (digits from
scikit-learn, see _digits_data.py) and the device lines, which also allow a CPU-only machine.

    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 4}' smddprun -np 2 python seed002_auto_partition.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import smdistributed.modelparallel.torch as smp
from _digits_data import digits_dataset, shard


class GroupedNet(nn.Module):
    def __init__(self):
        super(GroupedNet, self).__init__()
        # define layers (the MNIST example's network, for 8x8 images)
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        # define forward pass and return model outputs
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


# smdistributed: Define smp.step. Return any tensors needed outside.
@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, device, train_loader, optimizer):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        # smdistributed: Move input tensors to the GPU ID used by the current process,
        # based on the set_device call.
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        # Return value, loss_mb is a StepOutput object
        _, loss_mb = train_step(model, data, target)

        # smdistributed: Average the loss across microbatches.
        loss = loss_mb.reduce_mean()

        optimizer.step()
        if batch_idx == 0 or batch_idx == len(train_loader) - 1:
            print(f"rank {smp.rank()} batch {batch_idx} loss {loss.item():.4f}", flush=True)


# smdistributed: initialize the backend
smp.init()

# smdistributed: Set the device to the GPU ID used by the current process.
# Input tensors should be transferred to this device.
if torch.cuda.is_available():
    torch.cuda.set_device(smp.local_rank())
    device = torch.device("cuda")
else:
    device = torch.device("cpu")

dataset = digits_dataset()

# smdistributed: Shard the dataset based on data-parallel ranks
if smp.dp_size() > 1:
    dataset = shard(dataset, smp.dp_rank(), smp.dp_size())

# smdistributed: Set drop_last=True to ensure that batch size is always divisible
# by the number of microbatches
train_loader = torch.utils.data.DataLoader(dataset, batch_size=64, drop_last=True)

model = GroupedNet()
optimizer = optim.Adadelta(model.parameters(), lr=4.0)

# smdistributed: Use the DistributedModel container to provide the model
# to be partitioned across different ranks. For the rest of the script,
# the returned DistributedModel object should be used in place of
# the model provided for DistributedModel class instantiation.
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(optimizer)

train(model, device, train_loader, optimizer)
