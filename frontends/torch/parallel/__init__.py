"""smdistributed.dataparallel.torch.parallel: the older DistributedDataParallel wrapper."""
from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
