"""The parts of stage_graphs.py that need no GPU, in process: a capture runs the stage on
aliases of its parameters and must leave the very same Parameter objects registered after,
also when the run lists one module twice (the CUDA side is in tests/test_cuda.py)."""
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from smdistributed.modelparallel.torch.stage_graphs import _named_params_needing_grad, _on_aliases  # noqa: E402


def test_a_run_on_aliases_puts_back_the_parameters_of_a_module_listed_twice():
    torch.manual_seed(0)
    lin, tied = nn.Linear(4, 4), nn.Linear(4, 4)
    tied.weight = lin.weight  # the same Parameter registered in two modules
    modules = [lin, nn.ReLU(), tied, nn.LayerNorm(4), lin]
    before = {(id(m), n): p for m in nn.Sequential(*modules).modules() for n, p in m._parameters.items()}
    named = _named_params_needing_grad(modules)
    aliases = {n: p.detach().requires_grad_() for n, p in named}
    run = nn.Sequential(*modules)
    x = torch.randn(3, 4)
    with _on_aliases(run, aliases):
        out = run(x)
        assert lin.weight is aliases["0.weight"] and tied.weight is aliases["0.weight"]
    after = {(id(m), n): p for m in run.modules() for n, p in m._parameters.items()}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), "a parameter was not put back"
    assert all(type(p) is nn.Parameter for p in run.parameters())
    # The gradients went to the aliases, as the capture needs; the same as the plain module's.
    out.sum().backward()
    assert all(p.grad is None for p in run.parameters())
    run(x).sum().backward()
    for name, p in named:
        torch.testing.assert_close(aliases[name].grad, p.grad, msg=name)


def test_a_hook_on_a_parameter_gradient_keeps_the_run_eager():
    """A graphed backward adds the gradients to buffers, not through the parameters' own
    accumulation, so a hook on a parameter's gradient would not run: the runtime's check
    (RunView.hooked_or_checkpointed, at each call) must see it, and see it gone once removed."""
    from smdistributed.modelparallel.torch.run_view import RunView

    modules = [nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4))]
    view = RunView(modules)
    assert not view.hooked_or_checkpointed()
    weight = modules[2][0].weight
    handle = weight.register_hook(lambda g: g * 0.5)
    assert view.hooked_or_checkpointed()
    handle.remove()
    assert not view.hooked_or_checkpointed()
    handle = modules[0].bias.register_post_accumulate_grad_hook(lambda p: None)
    assert view.hooked_or_checkpointed()
    handle.remove()
    assert not view.hooked_or_checkpointed()
    handle = modules[1].register_forward_hook(lambda m, i, o: o)  # a module hook, as before
    assert view.hooked_or_checkpointed()


def test_a_capture_notices_what_its_graph_took_as_fixed():
    """Besides parameters and buffers, a graph reads the submodules' plain attributes as they
    were at its capture: a tensor kept as an attribute (a rotary cache rebuilt for a longer
    sequence: the graph would read the old one's freed memory) or a Python scalar (a rate);
    and a parameter sliced in place keeps its data pointer, not its shape."""
    from smdistributed.modelparallel.torch.run_view import RunView

    torch.manual_seed(0)
    drop, lin = nn.Dropout(0.1), nn.Linear(4, 4)
    lin.cache = torch.ones(4)
    view = RunView([lin, drop])
    snap = view.attributes()
    assert snap.changed() == ""
    drop.p = 0.2
    assert "0.2" in snap.changed()
    drop.p = 0.1
    assert snap.changed() == ""
    lin.eval()  # the fingerprint's (a mode toggled for evaluation is not an attribute change)
    assert snap.changed() == ""
    lin.train()
    lin.cache = torch.ones(4)
    assert "'cache'" in snap.changed()
    snap = view.attributes()
    del lin.cache
    assert "'cache'" in snap.changed()
    before = view.fingerprint()
    lin.weight.data = lin.weight.data[:2]
    assert view.fingerprint() != before


def test_global_module_hooks_keep_runs_eager():
    from smdistributed.modelparallel.torch.run_view import RunView

    view = RunView([nn.Linear(4, 4)])
    assert not view.hooked_or_checkpointed()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert view.hooked_or_checkpointed()
    finally:
        handle.remove()
    assert not view.hooked_or_checkpointed()


class _ListedWeight(nn.Module):
    """A parameter kept in a plain list: torch does not register it, so a graph taken with
    respect to the registered parameters would give it no gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = [nn.Parameter(torch.randn(4))]
        self.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.counts = torch.zeros(1)

    def forward(self, x):
        return self.lin(x) * self.extra[0] + self.frozen


def test_what_the_warm_run_finds_and_undoes():
    """The warm run before a capture is one forward too many: it must find a parameter that
    is not registered (the graph would give it no gradient) and undo exactly what the forward
    changed (an EMA buffer, a cache attribute replaced), without touching what it did not
    change, which earlier microbatches' backwards, still pending, may have saved."""
    from smdistributed.modelparallel.torch.stage_graphs import _ForwardEffects, _stray_leaves

    torch.manual_seed(0)
    m = _ListedWeight()
    named = _named_params_needing_grad([m])
    aliases = {n: p.detach().requires_grad_() for n, p in named}
    with _on_aliases(nn.Sequential(m), aliases):
        out = m(torch.randn(2, 4))
    strays = _stray_leaves(out, list(aliases.values()))
    assert len(strays) == 1 and strays[0] is m.extra[0]

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.trained = nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))
            self.cache = torch.ones(4)

        def forward(self, x):
            h = self.trained(self.frozen(x) * self.cache)  # (x's gradient needs the frozen weight and the cache)
            with torch.no_grad():
                self.ema.mul_(0.5).add_(h.mean(0))
            self.cache = torch.full((4,), 2.0)  # rebuilt
            return h

    run = nn.Sequential(Stateful())
    pending = run(torch.randn(3, 4, requires_grad=True)).sum()  # an earlier microbatch's backward, not run yet
    ema, cache, weight_version = run[0].ema.clone(), run[0].cache, run[0].frozen.weight._version
    effects = _ForwardEffects(run)
    run(torch.randn(3, 4, requires_grad=True))  # the warm run's forward
    assert effects.undo() == ""
    assert torch.equal(run[0].ema, ema) and run[0].cache is cache
    assert run[0].frozen.weight._version == weight_version
    pending.backward()  # what it saved is intact

    class ChangesAFrozenParameter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

        def forward(self, x):
            with torch.no_grad():
                self.scale.mul_(0.9)
            return self.lin(x) * self.scale

    run = nn.Sequential(ChangesAFrozenParameter())
    effects = _ForwardEffects(run)
    run(torch.randn(2, 4))
    assert "needs no gradient" in effects.undo()


def test_the_host_random_states_compare_and_restore():
    import random

    import numpy
    from smdistributed.modelparallel.torch.stage_graphs import _host_rng_states, _same_state, _set_host_rng_states

    before = _host_rng_states()
    assert set(before) == {"torch's CPU generator", "Python's random", "numpy.random"}
    assert all(_same_state(before[k], v) for k, v in _host_rng_states().items())
    for draw in (lambda: torch.rand([]), random.random, numpy.random.rand):
        draw()
        after = _host_rng_states()
        assert sum(not _same_state(before[k], after[k]) for k in before) == 1, draw
        _set_host_rng_states(before)
        assert all(_same_state(before[k], v) for k, v in _host_rng_states().items())
