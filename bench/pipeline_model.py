"""The pipeline benchmarks' model, loss and smp step function (pipeline_bench.py,
pipeline_profile.py, smp_overhead_profile.py): a stack of TransformerEncoderLayers, the mean
square of the output against a target, SGD."""
import torch


def encoder_layers(n, d=1024, heads=16, ffn=4096):
    """`n` encoder layers, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    return [torch.nn.TransformerEncoderLayer(d, heads, ffn, batch_first=True, dropout=0.0) for _ in range(n)]


def loss_fn(out, target):
    return (out.float() - target.float()).pow(2).mean()


def smp_train_step(smp):
    """The @smp.step function the benchmarks time: forward, loss, model.backward."""
    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(model(x), y)
        model.backward(loss)
        return loss

    return train_step
