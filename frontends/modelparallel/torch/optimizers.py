"""smp.optimizers: the original's replacements for apex's FusedLAMB and FusedNovoGrad are not
built yet (LAMB's gradient clipping needs the norm over every partition's gradients). Their
names raise an error that says so instead of a bare AttributeError."""

_NOT_YET = {"FusedLamb", "FusedNovoGrad"}


def __getattr__(name: str):
    if name in _NOT_YET:
        raise AttributeError(f"smp.optimizers.{name} is not available in this implementation yet; torch.optim's "
                             "optimizers (AdamW, ...) work with smp.DistributedOptimizer")
    raise AttributeError(f"module 'smdistributed.modelparallel.torch.optimizers' has no attribute '{name}'")
