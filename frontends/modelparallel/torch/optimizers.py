"""smp.optimizers: the original's replacements for apex's FusedLAMB and FusedNovoGrad.

FusedLamb makes apex FusedLAMB's update (same arguments and defaults) in plain torch, so it
needs no apex and runs on CPUs too. apex's own does not work under pipeline parallelism: it
clips by the norm of the gradients it sees, and each rank sees only its partition's, so every
stage would clip by a different factor. Here the norm is taken over every partition's
gradients (a tied weight counted once), and every rank clips by the same factor, as one process
training the whole model would.

FusedNovoGrad makes apex FusedNovoGrad's update (same arguments and defaults) in plain torch.
Its second moment is one norm per tensor, so each rank's update needs only its own partition's
gradients: no collective, and equal on every holder of a tied weight and every replica.
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


class _ApexStyleOptimizer(torch.optim.Optimizer):
    """What apex's fused optimizers share: zero_grad() follows `set_grad_none`, and step()
    evaluates an optional closure with gradients on before updating without them."""

    set_grad_none = True

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @staticmethod
    def _closure_loss(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class FusedLamb(_ApexStyleOptimizer):
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
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


class FusedNovoGrad(_ApexStyleOptimizer):
    """NovoGrad (Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments")
    as apex FusedNovoGrad makes it. Per tensor, with t the group's step:

    - the second moment is a norm of the whole gradient (L2 for norm_type=2, max |g| for 0),
      kept as the norm itself: v = sqrt(beta2 v^2 + (1 - beta2) n^2), or for the infinity norm
      beta2 v + (1 - beta2) n. It starts at the first gradient's norm (the first blend changes
      nothing), or at 0 with init_zero;
    - with bias correction, m is divided by 1 - beta1^t and v by sqrt(1 - beta2^t);
    - the first moment weighs what it takes by 1 - beta1 (grad_averaging), else by 1;
    - reg_inside_moment=False (apex's default): m takes the gradient, and the parameter moves by
      lr x (m / (v + eps) + weight_decay x parameter); reg_inside_moment=True (the paper's):
      m takes g / (v + eps) + weight_decay x parameter, and the parameter moves by lr x m.

    Computed in float32 and stored in the parameter's dtype, as apex does. The per-tensor norm
    lives in the optimizer's state (apex keeps it in the parameter group), so state_dict() and
    smp.save carry it."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, reg_inside_moment: bool = False,
                 grad_averaging: bool = True, norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise RuntimeError("smp.optimizers.FusedNovoGrad does not support the AMSGrad variant (nor does apex's)")
        if norm_type not in (0, 2):
            raise ValueError("smp.optimizers.FusedNovoGrad: norm_type must be 2 (L2) or 0 (infinity), "
                             f"got {norm_type!r}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults)
        self.reg_inside_moment, self.set_grad_none = reg_inside_moment, set_grad_none

    def load_state_dict(self, state_dict) -> None:
        """torch casts every tensor of a parameter's state to the parameter's dtype; the norms
        are put back in float32 from the saved values (in bf16 a norm keeps 3 digits, in fp16
        one above 65504 becomes inf and its tensor would never move again)."""
        norms = {i: st["exp_avg_sq"] for i, st in state_dict["state"].items() if "exp_avg_sq" in st}
        super().load_state_dict(state_dict)
        # torch pairs the saved ids with this optimizer's parameters in group order.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            if i in norms:
                self.state[p]["exp_avg_sq"] = torch.as_tensor(norms[i]).to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            self._update_group(group)
        return loss

    def _update_group(self, group) -> None:
        beta1, beta2 = group["betas"]
        decay, eps, lr, t = group["weight_decay"], group["eps"], group["lr"], group["step"]
        correction1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
        correction2 = (1 - beta2 ** t) ** 0.5 if group["bias_correction"] else 1.0
        weight = (1 - beta1) if group["grad_averaging"] else 1.0
        l2 = group["norm_type"] == 2
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("smp.optimizers.FusedNovoGrad does not support sparse gradients")
            g = p.grad.float()
            n = g.norm() if l2 else g.abs().max()
            st = self.state[p]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p)
            if "exp_avg_sq" not in st:  # also a state saved by apex's, which keeps the norms in the group
                st["exp_avg_sq"] = torch.zeros_like(n) if group["init_zero"] else n.clone()
            v = st["exp_avg_sq"].float()
            v = (beta2 * v * v + (1 - beta2) * n * n).sqrt() if l2 else beta2 * v + (1 - beta2) * n
            st["exp_avg_sq"] = v
            denom = v / correction2 + eps
            value = p.float()
            m = st["exp_avg"].float()
            if self.reg_inside_moment:
                m.mul_(beta1).add_(g / denom + decay * value, alpha=weight)
                update = m / correction1
            else:
                m.mul_(beta1).add_(g, alpha=weight)
                update = (m / correction1) / denom + decay * value
            st["exp_avg"].copy_(m)
            p.copy_(value - lr * update)
