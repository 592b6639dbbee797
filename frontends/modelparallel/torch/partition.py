"""Which partition each module belongs to: manual (smp.partition contexts) or automatic.

Manual: a module created inside `with smp.partition(i):` belongs to partition i (the
innermost context wins); any other module to `default_partition`.

Automatic: the model is traced once (trace.py): the order modules are first called in, their
parameter bytes, output bytes and optionally times. Modules are then cut into units: starting
from the root, a module whose cost exceeds one partition's share is replaced by the children
it calls, in call order, until every unit fits or cannot be split. The units, in call order,
are cut into `partitions` contiguous runs by dynamic programming, minimising the largest run's
cost, where cost = (1 - memory_weight) * compute share + memory_weight * memory share. A split
module stays with its first unit's partition, so its forward starts where its first child runs.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch.nn as nn

from .trace import Trace

_stack = threading.local()
_original_init = nn.Module.__init__
_patch_lock = threading.Lock()
_depth = 0


def _tagging_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    stack = getattr(_stack, "items", None)
    if stack:
        object.__setattr__(self, "_smp_partition", stack[-1])


@contextmanager
def partition(index: int):
    """Modules created inside belong to partition `index` (smp.partition)."""
    from .state import state

    state.require_init("smp.partition")
    p = state.cfg.partitions
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < p:
        raise ValueError(f"smp.partition({index!r}): the index must be an integer in 0..{p - 1} "
                         f"('partitions' is {p})")
    global _depth
    items = getattr(_stack, "items", None)
    if items is None:
        items = _stack.items = []
    with _patch_lock:
        if _depth == 0:
            nn.Module.__init__ = _tagging_init
        _depth += 1
    items.append(index)
    try:
        yield
    finally:
        items.pop()
        with _patch_lock:
            _depth -= 1
            if _depth == 0:
                nn.Module.__init__ = _original_init


def manual_assignment(root: nn.Module, default_partition: int) -> Dict[str, int]:
    return {path: getattr(m, "_smp_partition", default_partition)
            for path, m in root.named_modules()}


def _linear_partition(costs: List[float], parts: int) -> List[int]:
    """Start index of each of `parts` contiguous runs minimising the largest run's sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest run cutting costs[:i] into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(0, n + 1):
            for j in range(0, i + 1):
                if best[k - 1][j] == inf:
                    continue
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = v, j
    starts = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        starts.append(j)
        i = j
    return list(reversed(starts))


def auto_assignment(root: nn.Module, trace: Trace, parts: int, memory_weight: float) -> Dict[str, int]:
    paths = {id(m): p for p, m in root.named_modules()}
    children: Dict[str, List[str]] = {p: [] for p in paths.values()}
    for path, m in root.named_modules():
        for child in m.children():
            cp = paths[id(child)]
            if cp.rsplit(".", 1)[0] == path or (path == "" and "." not in cp):
                children[path].append(cp)
    order = {p: i for i, p in enumerate(trace.order)}

    comp = {p: trace.compute.get(p, 0.0) for p in paths.values()}
    mem = {p: trace.memory.get(p, 0.0) for p in paths.values()}
    total_comp = comp.get("", 0.0) or 1.0
    total_mem = mem.get("", 0.0) or 1.0

    def cost(p: str) -> float:
        return (1 - memory_weight) * comp[p] / total_comp + memory_weight * mem[p] / total_mem

    share = cost("") / parts
    units: List[str] = []
    split_first: Dict[str, str] = {}

    def called_below(p: str) -> List[str]:
        # A container that is never called itself (a ModuleList or ModuleDict the parent's
        # forward loops over) is seen through: its called modules are the parent's units.
        out = []
        for c in children[p]:
            out.extend([c] if c in order else called_below(c))
        return out

    def expand(p: str) -> None:
        called = sorted(called_below(p), key=lambda c: order[c])
        if parts > 1 and cost(p) > share and called:
            split_first[p] = called[0]
            for c in called:
                expand(c)
        else:
            units.append(p)

    expand("")
    starts = _linear_partition([cost(u) for u in units], parts)
    assignment: Dict[str, int] = {}
    unit_part: Dict[str, int] = {}
    for k in range(parts):
        end = starts[k + 1] if k + 1 < parts else len(units)
        for u in units[starts[k]:end]:
            unit_part[u] = k

    def first_part(p: str) -> int:
        while p in split_first:
            p = split_first[p]
        return unit_part[p]

    def assign(p: str, inherited: Optional[int]) -> None:
        if p in unit_part:
            part = unit_part[p]
            for q, _ in _subtree(root, p):
                assignment.setdefault(q, part)
            return
        part = first_part(p) if p in split_first else inherited
        assignment[p] = part
        for c in children[p]:
            assign(c, part)

    assign("", 0)
    for p in paths.values():
        assignment.setdefault(p, 0)
    return assignment


def _subtree(root: nn.Module, path: str):
    m = root.get_submodule(path) if path else root
    for sub, mod in m.named_modules():
        yield (f"{path}.{sub}" if path and sub else path or sub), mod


def describe(root: nn.Module, assignment: Dict[str, int], parts: int) -> str:
    lines = [f"smp: partitioned the model into {parts} partitions:"]
    for k in range(parts):
        params = sum(p.numel() for path, m in root.named_modules() if assignment.get(path) == k
                     for p in m.parameters(recurse=False))
        def parent(path):
            return path.rsplit(".", 1)[0] if "." in path else ""

        tops = [path for path, _ in root.named_modules()
                if path and assignment.get(path) == k and (parent(path) == "" or assignment.get(parent(path)) != k)]
        lines.append(f"  partition {k}: {params:,} parameters; " + (", ".join(tops[:12]) or "(root only)")
                     + (" ..." if len(tops) > 12 else ""))
    return "\n".join(lines)
