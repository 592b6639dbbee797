"""weight_split.py on CPU, in process: a backward split into its input pass and its weight pass
gives exactly the gradients of one backward, the input pass skips the weights' matrix products,
and a backward that cannot be split exactly is refused (it then runs in one pass). The CUDA
graphs of the two passes are tested on a GPU (tests/test_cuda.py)."""
import collections

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from smdistributed.modelparallel.torch.weight_split import (  # noqa: E402
    NotSplittable, SplitPlan, check, input_pass, weight_pass)


class _BranchesShareALinear(nn.Module):
    """One Linear on two parallel branches of the input's path: each branch's entry point
    gives the weight a share."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(x) * torch.tanh(self.shared(2 * x))


class _SideParameter(nn.Module):
    """A parameter that reaches the output without touching the input (a learned offset), and a
    frozen one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.offset = nn.Parameter(torch.randn(8))
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + torch.sin(self.offset) + self.frozen


class _HookedIntermediate(nn.Module):
    """A hook on an intermediate tensor that doubles its gradient: the weight pass feeds the
    kept gradient into the same node, where the hook would run a second time."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: g * 2)
        return self.b(torch.relu(h))


class _ScalesGradInPlace(torch.autograd.Function):
    """x @ w whose backward scales its incoming gradient in place (some custom Functions do)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g.mul_(2)
        return g @ w.t(), x.t() @ g


class _CustomMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return _ScalesGradInPlace.apply(x, self.w)


def _models():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    return {
        "encoder": (nn.Sequential(*[nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.1)
                                    for _ in range(3)]), (2, 5, 32)),
        "mlp-batchnorm-dropout": (nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                                                nn.Linear(16, 8)), (6, 8)),
        "branches-share-a-linear": (nn.Sequential(_BranchesShareALinear(), nn.Linear(8, 3)), (4, 8)),
        "side-parameter": (nn.Sequential(nn.LayerNorm(8), _SideParameter()), (4, 8)),
        "reused-layer": (nn.Sequential(lin, nn.ReLU(), lin), (4, 8)),
        "hooked-intermediate": (nn.Sequential(nn.Linear(8, 8), _HookedIntermediate()), (4, 8)),
        "custom-function": (nn.Sequential(nn.Linear(8, 8), _CustomMatmul(), nn.Linear(8, 8)), (4, 8)),
    }


def _graph(model, shape):
    """A forward on parameter aliases (fresh leaves on the same memory), as stage_graphs.py
    captures it; returns the output, the input, the aliases and an output gradient."""
    aliases = {n: p.detach().requires_grad_() for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(1)  # the dropout masks
    x = torch.randn(*shape, requires_grad=True)
    out = torch.func.functional_call(model, aliases, (x,))
    return out, x, list(aliases.values()), torch.randn_like(out)


@pytest.mark.parametrize("name", ["encoder", "mlp-batchnorm-dropout", "branches-share-a-linear", "side-parameter",
                                  "hooked-intermediate"])
def test_split_backward_equals_one_backward(name):
    model, shape = _models()[name]
    out, x, params, grad_out = _graph(model, shape)
    want = torch.autograd.grad(out, [x] + params, grad_out, retain_graph=True, allow_unused=True)
    plan = SplitPlan(out, x, params)
    grad_in, kept = input_pass(plan, out, x, grad_out)
    # The input's gradient is final before any weight's is computed.
    torch.testing.assert_close(grad_in, want[0], rtol=1e-6, atol=1e-7)
    got = weight_pass(plan, kept, params)
    assert len(got) == len(params)
    for i, (g, w) in enumerate(zip(got, want[1:])):
        assert (g is None) == (w is None), f"parameter {i}: one pass gives {w is not None}, split gives {g is not None}"
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=f"parameter {i} ({tuple(w.shape)})")
    check(out, x, params, grad_out)  # what stage_graphs runs before a capture: no objection


def test_a_second_split_backward_of_one_forward_adds_up():
    """A skip connection runs one backward twice: each split pair must be complete by itself."""
    model, shape = _models()["encoder"]
    out, x, params, g1 = _graph(model, shape)
    g2 = torch.randn_like(g1)
    want = torch.autograd.grad(out, [x] + params, g1 + g2, retain_graph=True)
    plan = SplitPlan(out, x, params)
    total_in, total_w = 0, [0] * len(params)
    for g in (g1, g2):
        grad_in, kept = input_pass(plan, out, x, g)
        total_in = total_in + grad_in
        total_w = [a + b for a, b in zip(total_w, weight_pass(plan, kept, params))]
    # (Two backwards round differently from one of the summed gradient: compared by norm.)
    for a, b in zip([total_in] + total_w, want):
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-6, ((a - b).norm(), b.norm())


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_the_input_pass_skips_the_weights_products_and_nothing_is_computed_twice():
    model, shape = _models()["encoder"]
    out, x, params, grad_out = _graph(model, shape)
    plan = SplitPlan(out, x, params)
    with _Count() as whole:
        torch.autograd.grad(out, [x] + params, grad_out, retain_graph=True)
    with _Count() as first:
        _, kept = input_pass(plan, out, x, grad_out)
    with _Count() as second:
        weight_pass(plan, kept, params)
    products = lambda c: c.ops["aten.mm"] + c.ops["aten.addmm"] + c.ops["aten.bmm"]  # noqa: E731
    # 3 layers x 4 Linears: the input pass computes each one's input gradient and no weight's,
    # the weight pass each weight's; attention's batched products belong to the input pass.
    assert products(first) + products(second) == products(whole), (first.ops, second.ops, whole.ops)
    assert first.ops["aten.mm"] == second.ops["aten.mm"] == 12, (first.ops, second.ops)
    assert second.ops["aten.bmm"] == 0, second.ops


def test_a_weight_used_twice_along_the_input_path_is_refused():
    model, shape = _models()["reused-layer"]
    out, x, params, _ = _graph(model, shape)
    with pytest.raises(NotSplittable, match="reached twice along the input's path"):
        SplitPlan(out, x, params)


def test_a_custom_function_on_the_input_path_is_refused():
    """Its backward may act on its incoming gradient (here: scales it in place, which would
    scale a kept gradient too) or do more than compute gradients; the split would run it twice."""
    model, shape = _models()["custom-function"]
    out, x, params, grad_out = _graph(model, shape)
    with pytest.raises(NotSplittable, match="custom autograd.Function"):
        SplitPlan(out, x, params)
    with pytest.raises(NotSplittable, match="custom autograd.Function"):
        check(out, x, params, grad_out)


def test_an_output_that_does_not_depend_on_the_input_is_refused():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    w = lin.weight.detach().requires_grad_()
    out = torch.randn(2, 4) @ w
    with pytest.raises(NotSplittable, match="does not depend on the input"):
        SplitPlan(out + 0 * x.detach(), x, [w])
