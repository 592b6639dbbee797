"""CUDA collectives of a group whose ranks share a GPU: through host memory and the CPU engine.

NCCL runs nothing between two ranks of one device (a communicator with two ranks on one GPU
fails with "invalid usage"), yet several processes on one GPU is how a script is tried on a
workstation, and how a pipeline's stages share a small machine. So when a group's ranks
share a GPU, its collectives on CUDA tensors do what gloo does with them: each call copies
its CUDA tensors to host memory (after the work the caller's stream has queued on them), runs
the group's CPU collective on the copies, and copies the results back into the caller's
tensors before its Work completes. The engine negotiates and checks the call as for any CPU
collective, so mismatches and dead peers raise the same errors. It is slower than NCCL, and
correct; rank 0 warns once.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

# A call's first argument is what it writes (in place, or its outputs), except for send.
_READ_ONLY = {"send"}
_warned = False


def cuda_tensors(args) -> List[torch.Tensor]:
    """The CUDA tensors in a call's arguments (tensors, lists of them, lists of lists)."""
    return [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_cuda]


def _to_host(obj, pairs: List[Tuple[torch.Tensor, torch.Tensor]]):
    """`obj` with each CUDA tensor replaced by a host copy in pinned memory, queued on the
    caller's current stream (after the work that writes it); (original, copy) appended to
    pairs. The caller synchronizes before anything reads the copies. (Pageable copies, made
    fresh at each call, ran at a third of gloo's speed at 64 MB: page faults and staged DMA;
    torch's host allocator keeps pinned blocks for reuse.)"""
    def stage(t):
        if not (isinstance(t, torch.Tensor) and t.is_cuda):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        pairs.append((t, host))
        return host

    return tree_map(stage, obj)


def _copy_back(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The host results into the caller's CUDA tensors, on the GPU before this returns: the
    Work completes (and its future's readers run, on any stream) only after it."""
    with torch.no_grad():
        for original, host in pairs:
            original.copy_(host, non_blocking=True)
    _synchronize(pairs)


def _synchronize(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Waits for the copies queued on the current streams of the pairs' devices."""
    for device in {original.device for original, _ in pairs}:
        torch.cuda.current_stream(device).synchronize()


def warn_once(rank: int, sharing: List[List[int]]) -> None:
    global _warned
    if _warned or rank != 0:
        return
    _warned = True
    groups = "; ".join(", ".join(map(str, ranks)) for ranks in sharing)
    warnings.warn(f"smddp: ranks {groups} of a process group share one GPU, where NCCL cannot run; that group's "
                  "collectives on CUDA tensors go through host memory (correct, and slower than NCCL with one GPU "
                  "per rank)", stacklevel=3)


def run(pg, method: Callable, name: str, args: Tuple[Any, ...], kwargs) -> Any:
    """Runs `method` (a collective of the process group `pg`) on host copies of its CUDA
    tensors; its Work copies the results back when it completes."""
    outputs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    inputs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    staged = [_to_host(a, outputs if i == 0 and name not in _READ_ONLY else inputs) for i, a in enumerate(args)]
    _synchronize(outputs + inputs)  # the copies are in host memory before the engine reads them
    work = method(pg, *staged, **kwargs)
    # The future holds the caller's tensors, as with NCCL, not the host copies (the CPU path,
    # like any caller of it, may drop its inputs in flight: it keeps what the engine reads).
    of_copy = {id(host): original for original, host in outputs + inputs}
    work.after_results(lambda: _copy_back(outputs),
                       lambda result: tree_map(lambda t: of_copy.get(id(t), t), result))
    return work
