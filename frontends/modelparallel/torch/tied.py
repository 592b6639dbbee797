"""Tied weights across partitions: one parameter used by modules on several partitions (a
language model's input embedding and its output projection).

Each partition that uses it holds a copy. The copies start equal (broadcast from the lowest
of those pipeline ranks) and stay equal: after each step, every copy's gradient becomes the
sum of what each copy's modules contributed in that step, so every holder applies the same
update (DeepSpeed's tied layers and Megatron's embedding group do the same). Only the step's
own contribution is summed (the gradient before the step is kept aside and added back), so
gradients accumulated over several steps are not summed twice.

The groups: one per set of partitions that share parameters and per data-parallel replica,
made by every rank in the same order (new_group is collective over the world). With
data parallelism, tied parameters are averaged over replicas after this sum, in a reduction
of their own (the sum and the average commute; they are kept out of the early, overlapped
reduction of the other parameters, which may start before this sum).
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .topology import Topology


class TiedParameters:
    def __init__(self, groups: List[Tuple[Tuple[int, ...], List[nn.Parameter], object, int]]):
        # (pipeline ranks that hold them, this rank's copies, group, global rank of the lowest holder)
        self._groups = groups
        self._ids = {id(p) for _, params, _, _ in groups for p in params}
        self._before: Dict[int, Optional[torch.Tensor]] = {}

    @staticmethod
    def build(module: nn.Module, owners_of_param: Dict[int, FrozenSet[int]], topo: Topology) -> "TiedParameters":
        """Every rank calls it, with the same assignment."""
        params_of: Dict[Tuple[int, ...], List[nn.Parameter]] = {}
        for _, p in module.named_parameters():  # model order, each parameter once
            owners = owners_of_param[id(p)]
            if len(owners) > 1:
                params_of.setdefault(tuple(sorted(owners)), []).append(p)
        mine = []
        for owners in sorted(params_of):
            for d in range(topo.dp_size):
                ranks = [topo.global_rank(pp, d) for pp in owners]
                group = dist.new_group(ranks)
                if d == topo.dp_rank and topo.pp_rank in owners:
                    mine.append((owners, params_of[owners], group, ranks[0]))
        return TiedParameters(mine)

    @property
    def local(self) -> List[nn.Parameter]:
        return [p for _, params, _, _ in self._groups for p in params]

    def counted_elsewhere(self, pp_rank: int) -> set:
        """This rank's copies whose (summed, equal) gradient a lower holder counts, in a norm of
        the whole model's gradients."""
        return {id(p) for owners, params, _, _ in self._groups if owners[0] != pp_rank for p in params}

    def is_tied(self, p: nn.Parameter) -> bool:
        return id(p) in self._ids

    def synchronize_values(self) -> None:
        """Makes every copy equal to the lowest holder's (after partitioning)."""
        for _, params, group, first in self._groups:
            flat = _flatten_dense_tensors([p.data for p in params])
            dist.broadcast(flat, first, group=group)
            for p, v in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                p.data.copy_(v)

    def begin_step(self) -> None:
        """Sets the gradients accumulated so far aside: the step's own go to .grad."""
        self._before = {}
        for p in self.local:
            self._before[id(p)] = p.grad
            p.grad = None

    def end_step(self) -> None:
        """Sums the step's gradients over the copies, then adds back what was set aside. Every
        holder calls it after every step that ran a backward."""
        for _, params, group, _ in self._groups:
            params = [p for p in params if p.requires_grad]  # a frozen copy keeps no gradient
            if not params:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            for p, summed in zip(params, _unflatten_dense_tensors(flat, grads)):
                before = self._before.get(id(p))
                p.grad = summed if before is None else before.add_(summed)
        self._before = {}

    def restore(self) -> None:
        """A step that ran no backward (or failed): the gradients set aside come back as they were."""
        for p in self.local:
            if id(p) in self._before:
                before = self._before[id(p)]
                if before is not None:
                    p.grad = before if p.grad is None else before.add_(p.grad)
        self._before = {}
