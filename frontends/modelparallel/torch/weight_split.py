"""A stage's backward in two passes: its input's gradient first, its weights' gradients after.

Why: a stage that sends its input's gradient to the stage before it (every stage but the
first) makes that stage wait for its whole backward, weights' gradients included, although
nothing but its own optimizer needs those. Computing the input's gradient first and the
weights' gradients after it lets the gradient leave a weight pass earlier. In a 2-stage 1F1B
step the first stage's last backward then starts that much sooner: (3m + 2) instead of
(3m + 3) units of a forward for m microbatches, with forward, input gradient and weight
gradient one unit each (the "zero bubble" papers' B/W split, their ZB-H1 schedule restricted to
deferring within one microbatch).

How, on autograd's own graph of a captured forward (stage_graphs.py captures each pass as a
CUDA graph of its own):
- The input's path: the nodes from the output down to the input's gradient accumulator. The
  first pass is `autograd.grad(output, input)`: autograd computes only the gradients that lead
  to the input, so each matrix product's node skips its weight's half.
- Weight entry points: the nodes on the input's path with an edge leaving it toward
  parameters (a matrix product's node toward its weight's transpose and accumulator). A
  pre-hook on each keeps the gradient it received in the first pass.
- The second pass runs each entry point again from that kept gradient, asking only for its
  parameters: `autograd.grad(GradientEdge(node, k), params)`. The edges that lead back into the
  input's path are not needed for those parameters, so nothing of the first pass is redone.
That is exact only when each entry point's parameters are not also reachable through the
input's path below it (a module whose weight is used twice on that path, a tied weight): the
second pass would then flow down the input's path again and count that gradient twice. Such a
backward is not split (`NotSplittable`) and runs in one pass as before.

Cost: the kept gradients (about one activation-sized tensor per matrix product) live from the
first pass to the second; both passes are replayed back to back, so they take memory in the
rank's shared backward pool, not per microbatch.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node


class NotSplittable(Exception):
    """The backward cannot be split exactly (the message says why); it runs in one pass."""


def _accumulator(leaf: torch.Tensor) -> Node:
    """The gradient accumulator node of a leaf that needs a gradient. torch makes it lazily and
    keeps it while the leaf's graph uses it; a view's node points at the very same one."""
    node = leaf.view_as(leaf).grad_fn
    if node is None or not node.next_functions or node.next_functions[0][0] is None:
        raise NotSplittable("a leaf has no gradient accumulator")
    return node.next_functions[0][0]


class SplitPlan:
    """Where the weight pass starts, for one captured forward `out = run(x)` with the
    parameters `params` (aliases that are leaves)."""

    def __init__(self, out: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor]):
        root = out.grad_fn
        if root is None or not x.requires_grad:
            raise NotSplittable("the input needs no gradient: nothing to send earlier")
        x_acc = _accumulator(x)
        param_of = {_accumulator(p): i for i, p in enumerate(params)}
        order = self._post_order(root)
        on_path: Dict[Node, bool] = {}  # the node leads to the input's accumulator
        below: Dict[Node, frozenset] = {}  # indices of the parameters the node leads to
        for node in order:  # children before their parents
            kids = [c for c, _ in node.next_functions if c is not None]
            on_path[node] = node is x_acc or any(on_path[c] for c in kids)
            own = {param_of[node]} if node in param_of else set()
            below[node] = frozenset(own.union(*(below[c] for c in kids)))
        if not on_path[root]:
            raise NotSplittable("the output does not depend on the input")
        self.entries: List[Tuple[Node, Tuple[int, ...]]] = []
        for node in order:
            if not on_path[node] or node is x_acc:
                continue
            kids = [c for c, _ in node.next_functions if c is not None]
            leaving = frozenset().union(*(below[c] for c in kids if not on_path[c]))
            if not leaving:
                continue
            further = frozenset().union(*(below[c] for c in kids if on_path[c]))
            if leaving & further:
                raise NotSplittable(f"a parameter is reached twice along the input's path (at {node.name()}): "
                                    "a weight used by two layers")
            self.entries.append((node, tuple(sorted(leaving))))
        if not self.entries:
            raise NotSplittable("no parameter hangs off the input's path")

    @staticmethod
    def _post_order(root: Node) -> List[Node]:
        """Every node reachable from `root`, each after all the nodes it leads to (iterative:
        a stage's graph has thousands of nodes, deeper than Python's recursion limit)."""
        order, seen, stack = [], {root}, [(root, iter(root.next_functions))]
        while stack:
            node, kids = stack[-1]
            for child, _ in kids:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append((child, iter(child.next_functions)))
                    break
            else:
                stack.pop()
                order.append(node)
        return order


def input_pass(plan: SplitPlan, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor):
    """The first pass: returns the input's gradient and, for each entry point of `plan`, the
    gradients it received (kept for weight_pass). The graph is retained for the second pass."""
    kept: Dict[Node, tuple] = {}
    handles = []
    for node, _ in plan.entries:
        def keep(grad_outputs, node=node):
            kept[node] = tuple(grad_outputs)
        handles.append(node.register_prehook(keep))
    try:
        (grad_in,) = torch.autograd.grad(out, [x], grad_out, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_in, kept


def weight_pass(plan: SplitPlan, kept: Dict[Node, tuple],
                params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """The second pass: each parameter's gradient (None where none reached it), from the
    gradients the first pass kept. Each entry point runs alone, asking for its own parameters
    only, so its edges back into the input's path are not computed again."""
    grads: List[Optional[torch.Tensor]] = [None] * len(params)
    for node, indices in plan.entries:
        received = kept.get(node)
        if received is None:
            continue  # the first pass did not run it (no gradient reached it)
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(received) if g is not None]
        if not edges:
            continue
        found = torch.autograd.grad([e for e, _ in edges], [params[i] for i in indices], [g for _, g in edges],
                                    retain_graph=True, allow_unused=True)
        for i, g in zip(indices, found):
            if g is not None:
                # A parameter used on two parallel branches of the input's path gets a share
                # from each branch's entry point (one below the other was refused by the plan).
                grads[i] = g if grads[i] is None else grads[i] + g
    return grads
