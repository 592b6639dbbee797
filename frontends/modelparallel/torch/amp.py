"""smp.amp.GradScaler: torch's GradScaler, with the inf/nan check agreed by every rank.

Each rank holds only its partition's gradients, so torch's scaler would let one stage skip a
step (it saw an inf) while the others apply theirs, and the replicas would drift apart with
different scales. Here, after unscaling, each rank's "found inf" is combined with a MAX
all-reduce over the world (every pipeline and data-parallel rank), so every rank skips the
same steps and keeps the same scale. A rank that holds no parameters takes part too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    def __init__(self, *args, **kwargs):
        """torch.amp.GradScaler's arguments (device first), or torch.cuda.amp.GradScaler's,
        whose first is init_scale: GradScaler(1024.0) must not read 1024.0 as a device."""
        default = "cuda" if torch.cuda.is_available() else "cpu"
        if args and isinstance(args[0], (int, float)) and not isinstance(args[0], bool):
            args = (default, *args)
        elif not args:
            kwargs.setdefault("device", default)
        super().__init__(*args, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for found in per_device.values():
            local = torch.maximum(local, found.to(local.device))
        agreed = local.reshape(1)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if not per_device:
            per_device[self._scale.device] = agreed.reshape(())
        for found in per_device.values():
            found.copy_(agreed.reshape(()).to(found.device))
