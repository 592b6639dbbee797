"""Activation checkpointing: a marked module keeps only its inputs in the forward and
recomputes its activations in the backward (torch.utils.checkpoint, non-reentrant).

smp.set_activation_checkpointing(module) marks a module of the DistributedModel, before or
after partitioning; the module's owner applies it when it runs the module's forward. A module
whose submodules live on other partitions cannot be checkpointed (its recomputation would
repeat calls to other ranks), which is a clear error at its first call.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint as tc


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_activation_checkpointing expects an nn.Module, got {type(module).__name__}")
    if strategy not in ("each", "contiguous") and not strategy.startswith("group_"):
        raise ValueError(f"smp.set_activation_checkpointing: unknown strategy {strategy!r} "
                         "('each', 'contiguous' or 'group_N')")
    if isinstance(module, nn.Sequential) and strategy == "each":
        targets = list(module)  # each child separately, as the original's "each"
    else:
        targets = [module]
    for m in targets:
        object.__setattr__(m, "_smp_checkpoint", {"preserve_rng_state": preserve_rng_state})


def checkpoint_options(module: nn.Module) -> Optional[dict]:
    """The module's checkpointing options, None when it is not marked. Read from the instance's
    dict, where the mark is set: getattr of a name a Module lacks goes through Module.__getattr__,
    which raises and catches an AttributeError (about 1.7 us on this project's VM), and the
    pipeline asks this for every module call."""
    return module.__dict__.get("_smp_checkpoint")


def checkpointed(module: nn.Module, forward, args, kwargs):
    """Runs `forward` under checkpointing when `module` is marked and gradients are on."""
    options = checkpoint_options(module)
    if options is None or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return tc.checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=options["preserve_rng_state"],
                         **kwargs)


def checkpoint(function, *args, preserve_rng_state: bool = True, **kwargs):
    """The original's smp.checkpoint: checkpoint a function called inside a module's forward."""
    return tc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def checkpoint_sequential(sequential_module: nn.Sequential, input, strategy: str = "each",
                          preserve_rng_state: bool = True, pack_args_as_tuple: bool = False):
    """The original's smp.checkpoint_sequential: "each" child alone, "contiguous" as one
    segment, "group_N" in segments of N children."""
    n = len(sequential_module)
    if strategy == "each":
        segments = n
    elif strategy == "contiguous":
        segments = 1
    elif strategy.startswith("group_"):
        segments = max(1, -(-n // int(strategy.split("_", 1)[1])))
    else:
        raise ValueError(f"smp.checkpoint_sequential: unknown strategy {strategy!r}")
    return tc.checkpoint_sequential(sequential_module, segments, input, use_reentrant=False,
                                    preserve_rng_state=preserve_rng_state)
