"""The pipeline benchmarks' model, loss and step functions (pipeline_bench.py,
pipeline_profile.py, pipeline_peak_memory.py, smp_overhead_profile.py): a stack of
TransformerEncoderLayers, the mean square of the output against a target, SGD."""
import torch


def encoder_layers(n, d=1024, heads=16, ffn=4096):
    """`n` encoder layers, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    return [torch.nn.TransformerEncoderLayer(d, heads, ffn, batch_first=True, dropout=0.0) for _ in range(n)]


def loss_fn(out, target):
    return (out.float() - target.float()).pow(2).mean()


def smp_train_step(smp, host_delay=None):
    """The @smp.step function the benchmarks time: forward, loss, model.backward.
    `host_delay` (pipeline_bench's --host-delay) runs between the loss and the backward of
    each microbatch on every rank."""
    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(model(x), y)
        if host_delay is not None:
            host_delay()
        model.backward(loss)
        return loss

    return train_step


def smp_training_step(smp, n_layers, x, y):
    """The whole bf16 model under smp with SGD: (the DistributedModel, a training step that
    zeroes the gradients, runs the @smp.step function and steps the optimizer)."""
    model = smp.DistributedModel(torch.nn.Sequential(*encoder_layers(n_layers)).to(torch.bfloat16), trace_device="gpu")
    return model, smp_sgd_step(smp, model, x, y)


def smp_sgd_step(smp, model, x, y):
    """A training step of a DistributedModel: zero the gradients, run the @smp.step function
    on (x, y), step SGD."""
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    train_step = smp_train_step(smp)

    def step():
        opt.zero_grad(set_to_none=True)
        train_step(model, x, y)
        opt.step()

    return step


def torch_1f1b_training_step(n_layers, rank, pp, dev, group, m, x, y):
    """torch's Schedule1F1B over this rank's even share of the bf16 model, SGD: a training step
    (the first stage feeds `x`, the last computes the loss against `y`)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    part = torch.nn.Sequential(*encoder_layers(n_layers)[rank * n_layers // pp:(rank + 1) * n_layers // pp])
    part = part.to(dev, torch.bfloat16)
    sched = Schedule1F1B(PipelineStage(part, rank, pp, dev, group=group), n_microbatches=m, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()

    return step
