"""@smp.step: split the batch into microbatches, run them through the pipeline, and gather
what the function returns into StepOutputs."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional

import torch

from .nested import is_mapping, mapping_like
from .runtime import autocast_state
from .state import state


class StepOutput:
    """One returned tensor across microbatches (`outputs[mb]`)."""

    def __init__(self, outputs: List[torch.Tensor]):
        self.outputs = outputs

    def reduce_mean(self) -> torch.Tensor:
        return torch.stack(self.outputs).mean(0)

    def reduce_sum(self) -> torch.Tensor:
        return torch.stack(self.outputs).sum(0)

    def concat(self) -> torch.Tensor:
        return torch.cat(self.outputs)

    def stack(self) -> torch.Tensor:
        return torch.stack(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches)"


def _split(value: Any, m: int, axis: int, where: str) -> List[Any]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value] * m
        if axis >= value.dim():
            raise ValueError(f"smp.step: {where} has {value.dim()} dimensions; cannot split along axis {axis}")
        n = value.shape[axis]
        if n % m != 0:
            raise ValueError(f"smp.step: {where} has {n} samples along axis {axis}, which {m} microbatches do "
                             "not divide (use drop_last=True in the DataLoader, or another batch size)")
        return list(torch.split(value, n // m, dim=axis))
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(m, i, axis) for i in range(m)]
    if isinstance(value, (list, tuple, set)) and not isinstance(value, str):
        items = list(value)
        parts = [_split(v, m, axis, f"{where}[{i}]") for i, v in enumerate(items)]
        rebuild = type(value)
        if hasattr(value, "_fields"):  # namedtuple
            return [rebuild(*[p[i] for p in parts]) for i in range(m)]
        return [rebuild([p[i] for p in parts]) for i in range(m)]
    if is_mapping(value):
        parts = {k: _split(v, m, axis, f"{where}[{k!r}]") for k, v in value.items()}
        return [mapping_like(value, ((k, p[i]) for k, p in parts.items())) for i in range(m)]
    return [value] * m


def split_arguments(fn: Callable, args, kwargs, m: int, non_split: List[str], axes: Dict[str, int]):
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **kwargs)
    unknown = [n for n in [*non_split, *axes] if n not in signature.parameters]
    if unknown:
        raise ValueError(f"smp.step: non_split_inputs/input_split_axes name {unknown}, which are not "
                         f"parameters of {fn.__name__}")
    per_name = {}
    for name, value in bound.arguments.items():
        if name in non_split:
            per_name[name] = [value] * m
        else:
            per_name[name] = _split(value, m, axes.get(name, 0), f"argument '{name}'")
    out = []
    for i in range(m):
        b = inspect.BoundArguments(bound.signature, {n: v[i] for n, v in per_name.items()})
        out.append((b.args, b.kwargs))
    return out


def _outputs(results: List[Any], detach: bool) -> Any:
    first = results[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([r.detach() if detach else r for r in results])
    if isinstance(first, (list, tuple)):
        fields = (_outputs([r[i] for r in results], detach) for i in range(len(first)))
        return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)  # a named tuple
    if is_mapping(first):
        return mapping_like(first, ((k, _outputs([r[k] for r in results], detach)) for k in first))
    return list(results)


def step(func: Optional[Callable] = None, *, non_split_inputs=None, input_split_axes=None,
         detach_outputs: bool = True):
    """Usable bare (@smp.step) and called (@smp.step(non_split_inputs=[...]))."""

    def decorate(fn: Callable):
        non_split = list(non_split_inputs or [])
        axes = dict(input_split_axes or {})

        @functools.wraps(fn)
        def run(*args, **kwargs):
            state.require_init("smp.step")
            # Training calls are counted (before the batch is checked, so that a call refused on
            # one replica counts there); one that ran no backward is taken back, as evaluation
            # steps need not run on every replica.
            counted = torch.is_grad_enabled()
            state.step_calls += int(counted)
            model = state.model
            if model is None:
                raise RuntimeError("smp.step: no smp.DistributedModel exists (wrap the model before the first step)")
            m = state.cfg.microbatches
            microbatches = split_arguments(fn, args, kwargs, m, non_split, axes)
            if not model.partitioned:
                model._partition(fn, microbatches[0])
            results = model._run_step(fn, microbatches, torch.is_grad_enabled(), autocast_state())
            if counted and not model._runtime.backward_seen:
                state.step_calls -= 1
            return _outputs(results, detach_outputs)

        return run

    return decorate(func) if func is not None else decorate
