"""smp.optimizers: the original's replacements for apex's FusedLAMB and FusedNovoGrad.

FusedLamb makes apex FusedLAMB's update (same arguments and defaults) in plain torch, so it
needs no apex and runs on CPUs too. apex's own does not work under pipeline parallelism: it
clips by the norm of the gradients it sees, and each rank sees only its partition's, so every
stage would clip by a different factor. Here the norm is taken over every partition's
gradients (a tied weight counted once), and every rank clips by the same factor, as one process
training the whole model would.

FusedNovoGrad is not built: its name raises an error that says so.
"""
from __future__ import annotations

from typing import List, Set

import torch
import torch.distributed as dist

from .state import device as local_device, state


def _gradient_norm_over_partitions(params: List[torch.nn.Parameter], counted_elsewhere: Set[int]) -> torch.Tensor:
    """The L2 norm of the whole model's gradients. Each rank adds its own partition's; one
    replica's ranks speak for all (the replicas' gradients are equal after their averaging),
    so the sum over the world adds zeros from the others and is the pipeline's sum exactly."""
    on = params[0].grad.device if params else local_device()
    squares = torch.zeros((), dtype=torch.float32, device=on)
    for p in params:
        if id(p) not in counted_elsewhere:
            squares = squares + p.grad.float().pow(2).sum()
    model = state.model
    if state.initialized and model is not None and model.partitioned and state.topo.size > 1:
        if state.topo.dp_rank != 0:
            squares = torch.zeros_like(squares)
        squares = squares.reshape(1)
        dist.all_reduce(squares)
    return squares.reshape(()).sqrt()


class FusedLamb(torch.optim.Optimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning") as apex FusedLAMB makes it:

    - the gradients are divided by max(norm / max_grad_norm, 1), the norm taken over every
      gradient of the model (no clipping when max_grad_norm <= 0);
    - Adam's moments of that gradient (grad_averaging: the first weighs it by 1 - beta1, else
      by 1), with bias correction; adam_w_mode adds weight_decay x parameter to the update
      (decoupled), else to the gradient (L2);
    - each tensor moves by lr x ||parameter|| / ||update|| times its update (lr alone where
      either norm is 0, and for tensors without weight decay unless use_nvlamb).

    The moments are kept in the parameter's dtype and computed in float32, as apex does.
    Call step() on every rank (the norm is a collective), as smp scripts do."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True, max_grad_norm: float = 1.0,
                 use_nvlamb: bool = False):
        if amsgrad:
            raise RuntimeError("smp.optimizers.FusedLamb does not support the AMSGrad variant (nor does apex's)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode, self.set_grad_none, self.use_nvlamb = adam_w_mode, set_grad_none, use_nvlamb

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("smp.optimizers.FusedLamb does not support sparse gradients")
        model = state.model
        elsewhere = model._norm_counted_elsewhere() if model is not None and model.partitioned else set()
        norm = _gradient_norm_over_partitions(params, elsewhere)
        max_norm = self.defaults["max_grad_norm"]  # one clip for every group, as apex
        divisor = torch.clamp(norm / max_norm, min=1.0) if max_norm > 0 else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            self._update_group(group, divisor)
        return loss

    def _update_group(self, group, divisor) -> None:
        beta1, beta2 = group["betas"]
        decay, eps, lr, t = group["weight_decay"], group["eps"], group["lr"], group["step"]
        correction1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
        correction2 = 1 - beta2 ** t if group["bias_correction"] else 1.0
        weight = (1 - beta1) if group["grad_averaging"] else 1.0
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            value = p.float()
            g = p.grad.float()
            if divisor is not None:
                g = g / divisor
            if not self.adam_w_mode and decay != 0:
                g = g + decay * value
            m = st["exp_avg"].float().mul_(beta1).add_(g, alpha=weight)
            v = st["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / correction1) / ((v / correction2).sqrt() + eps)
            if self.adam_w_mode and decay != 0:
                update = update + decay * value
            rate = lr
            if self.use_nvlamb or decay != 0:  # the trust ratio, where both norms are non-zero
                p_norm, u_norm = value.norm(), update.norm()
                rate = torch.where((p_norm > 0) & (u_norm > 0), lr * p_norm / u_norm, lr)
            st["exp_avg"].copy_(m)
            st["exp_avg_sq"].copy_(v)
            p.copy_(value - rate * update)


def __getattr__(name: str):
    if name == "FusedNovoGrad":
        raise AttributeError("smp.optimizers.FusedNovoGrad is not available in this implementation yet; "
                             "smp.optimizers.FusedLamb and torch.optim's optimizers work with smp.DistributedOptimizer")
    raise AttributeError(f"module 'smdistributed.modelparallel.torch.optimizers' has no attribute '{name}'")
