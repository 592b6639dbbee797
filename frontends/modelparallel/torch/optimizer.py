"""smp.DistributedOptimizer: the user's optimizer, still a torch.optim.Optimizer (LR schedulers
keep working), with state-dict methods that know about partitions.

It was built over the whole model's parameters. Only this rank's partition gets gradients,
and torch optimizers skip parameters without one, so step() updates exactly the local
parameters (and nothing on a rank that holds none).
"""
from __future__ import annotations

import types
from typing import Any, Dict

import torch

from . import partial_state
from .state_merge import everyone_has_own_part, merge_over_pipeline
from .state import state


def _local_indices(opt: torch.optim.Optimizer) -> set:
    model = state.model
    local = {id(p) for p in model.local_parameters()}
    out, i = set(), 0
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in local:
                out.add(i)
            i += 1
    return out


def _local_state_dict(self) -> Dict[str, Any]:
    full = self._smp_plain_state_dict()
    keep = _local_indices(self)
    full["state"] = {k: v for k, v in full["state"].items() if k in keep}
    return partial_state.mark(full)


def _state_dict(self) -> Dict[str, Any]:
    if state.model is None or not state.model.partitioned:
        return self._smp_plain_state_dict()
    local = self.local_state_dict()
    local["state"] = merge_over_pipeline(local["state"])
    return partial_state.unmark(local)


def _load_state_dict(self, sd: Dict[str, Any]) -> None:
    sd = dict(sd)
    if partial_state.take(sd, "DistributedOptimizer.load_state_dict"):
        # Optimizer state is per parameter and optional: a rank that loaded exactly its own
        # parameters' entries loads them as they are (torch keeps no state for the others).
        own = state.model is not None and state.model.partitioned and set(sd["state"]) <= _local_indices(self)
        if not everyone_has_own_part(own):
            sd["state"] = merge_over_pipeline(sd["state"])
    self._smp_plain_load_state_dict(sd)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, **_ignored) -> torch.optim.Optimizer:
    state.require_init("smp.DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"smp.DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_smp_wrapped", False):
        return optimizer
    optimizer._smp_plain_state_dict = optimizer.state_dict
    optimizer._smp_plain_load_state_dict = optimizer.load_state_dict
    optimizer.local_state_dict = types.MethodType(_local_state_dict, optimizer)
    optimizer.state_dict = types.MethodType(_state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(_load_state_dict, optimizer)
    optimizer._smp_wrapped = True
    state.optimizers.append(optimizer)
    return optimizer


def follow_parameters(optimizer: torch.optim.Optimizer) -> None:
    """After partitioning: state loaded while every parameter was on the CPU moves to where
    its parameter now lives (torch keeps a non-capturable 'step' on the CPU)."""
    for p, st in optimizer.state.items():
        for key, value in list(st.items()):
            if isinstance(value, torch.Tensor) and key != "step" and value.device != p.device:
                st[key] = value.to(p.device)
