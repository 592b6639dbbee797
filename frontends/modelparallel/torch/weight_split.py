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
The second pass gives each entry point the gradient the first kept, through a pre-hook of its
own that runs after the tensors' hooks: a hook on an intermediate tensor (`h.register_hook`)
then acts once, as in one backward, not twice.

What is not split (`NotSplittable`; the run keeps one backward pass):
- an entry point whose parameters are also reachable through the input's path below it (a
  module whose weight is used twice on that path, a tied weight): the second pass would flow
  down the input's path again and count that gradient twice;
- a custom `autograd.Function` on the input's path: its backward may change its incoming
  gradient in place (which may be a kept one) or do something besides computing gradients,
  and the second pass would run an entry point of its kind again;
- a backward whose split does not reproduce one backward's gradients when checked once,
  eagerly, before the capture (stage_graphs.py's warm run; `check`).

Cost: the kept gradients (about one activation-sized tensor per matrix product) live from the
first pass to the second. No other backward replays in between (stage_graphs.py), so they take
memory in the rank's shared backward pool, not per microbatch.
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


def post_order(root: Node) -> List[Node]:
    """Every node of autograd's graph reachable from `root`, each after all the nodes it leads
    to (iterative: a stage's graph has thousands of nodes, deeper than Python's recursion
    limit)."""
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


class SplitPlan:
    """Where the weight pass starts, for one captured forward `out = run(x)` with the
    parameters `params` (aliases that are leaves)."""

    def __init__(self, out: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor]):
        root = out.grad_fn
        if root is None or not x.requires_grad:
            raise NotSplittable("the input needs no gradient: nothing to send earlier")
        x_acc = _accumulator(x)
        param_of = {_accumulator(p): i for i, p in enumerate(params)}
        order = post_order(root)
        on_path: Dict[Node, bool] = {}  # the node leads to the input's accumulator
        below: Dict[Node, frozenset] = {}  # indices of the parameters the node leads to
        for node in order:  # children before their parents
            kids = [c for c, _ in node.next_functions if c is not None]
            on_path[node] = node is x_acc or any(on_path[c] for c in kids)
            own = {param_of[node]} if node in param_of else set()
            below[node] = frozenset(own.union(*(below[c] for c in kids)))
        if not on_path[root]:
            raise NotSplittable("the output does not depend on the input")
        python_node = torch.autograd.function.BackwardCFunction
        custom = next((n for n in order if on_path[n] and isinstance(n, python_node)), None)
        if custom is not None:
            raise NotSplittable(f"a custom autograd.Function ({custom.name()}) is on the input's path")
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
        # The kept gradients already went through the hooks of the node's output tensors,
        # which run again here: this pre-hook, run after them, puts the kept ones back.
        handle = node.register_prehook(lambda _, received=received: received)
        try:
            found = torch.autograd.grad([e for e, _ in edges], [params[i] for i in indices], [g for _, g in edges],
                                        retain_graph=True, allow_unused=True)
        finally:
            handle.remove()
        for i, g in zip(indices, found):
            if g is not None:
                # A parameter used on two parallel branches of the input's path gets a share
                # from each branch's entry point (one below the other was refused by the plan).
                grads[i] = g if grads[i] is None else grads[i] + g
    return grads


def check(out: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor], grad_out: torch.Tensor) -> None:
    """Raises NotSplittable unless the split backward of `out` gives what one backward gives,
    `grad_out` in (to 1% of each gradient's norm: the same kernels, summed in another order
    where a parameter gets shares from two branches; what it guards against, a hook or a
    backward the split runs twice, is off by far more). Eager, on a forward of its own."""
    whole = torch.autograd.grad(out, [x] + list(params), grad_out, retain_graph=True, allow_unused=True)
    plan = SplitPlan(out, x, params)
    try:
        grad_in, kept = input_pass(plan, out, x, grad_out)
        split = [grad_in] + weight_pass(plan, kept, params)
    except RuntimeError as e:  # (a node that cannot run twice, say)
        raise NotSplittable(f"the split backward failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    for i, (a, b) in enumerate(zip(split, whole)):
        what = "the input's gradient" if i == 0 else f"parameter {i - 1}'s gradient"
        if (a is None) != (b is None):
            raise NotSplittable(f"{what} is {'missing' if a is None else 'extra'} in the split backward")
        if a is not None and (a.float() - b.float()).norm() > 0.01 * b.float().norm() + 1e-6:
            raise NotSplittable(f"the split backward's {what} differs from one backward's (a hook or a backward "
                                "that acts on its incoming gradient)")
