"""smdistributed.modelparallel.torch: configuration, layout and partition logic in process,
then pipelines of real processes trained against one process on the same batches."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402
from smdistributed.modelparallel.torch.config import ConfigError, resolve  # noqa: E402
from smdistributed.modelparallel.torch.partition import _linear_partition, auto_assignment  # noqa: E402
from smdistributed.modelparallel.torch.activation_checkpointing import checkpoint_options  # noqa: E402
from smdistributed.modelparallel.torch.scheduler import ComputeToken  # noqa: E402
from smdistributed.modelparallel.torch.run_view import RunView  # noqa: E402
from smdistributed.modelparallel.torch.stage_graphs import StageGraphs, _StepAccumulator  # noqa: E402
from smdistributed.modelparallel.torch.step import StepOutput, split_arguments  # noqa: E402
from smdistributed.modelparallel.torch.topology import Topology  # noqa: E402
from smdistributed.modelparallel.torch.trace import Tracer  # noqa: E402
from smdistributed.modelparallel.torch.wire import Links, take  # noqa: E402
from smdistributed.modelparallel.torch.workers import WorkerPool  # noqa: E402
from world import assert_all_ok, free_port, run_world  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "modelparallel"


# -- configuration -------------------------------------------------------------------------------
def test_config_defaults_follow_the_original():
    c = resolve({"partitions": 2}, 2, environ={})
    assert (c.microbatches, c.pipeline, c.optimize, c.memory_weight, c.placement_strategy) == \
        (1, "interleaved", "speed", 0.2, "cluster")
    assert (c.auto_partition, c.ddp, c.active_microbatches) == (True, False, 4)
    assert resolve({"partitions": 2, "optimize": "memory"}, 2, environ={}).memory_weight == 0.8


def test_sagemaker_parameters_win_over_the_dict_and_the_alias_is_accepted():
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"pipeline_parallel_degree": 4, "microbatches": 8})}
    c = resolve({"partitions": 2, "microbatches": 2, "ddp": True}, 8, environ=env)
    assert (c.partitions, c.microbatches) == (4, 8)


@pytest.mark.parametrize("config, world, fragment", [
    ({"partitions": 2, "microbatchs": 4}, 2, "unknown configuration key 'microbatchs'"),
    ({"partitions": 3}, 4, "world size 4 is not divisible by 'partitions' = 3"),
    ({"partitions": 2, "auto_partition": False}, 2, "needs 'default_partition'"),
    ({"partitions": 2, "auto_partition": False, "default_partition": 2}, 2, "only 2 partitions"),
    ({"partitions": 2}, 4, "needs 'ddp': true"),
    ({}, 2, "'partitions' (the pipeline-parallel degree) is required"),
    ({"partitions": 2, "pipeline": "1f1b"}, 2, "'pipeline' must be one of"),
    ({"partitions": 2, "tensor_parallel_degree": 2}, 2, "not supported"),
    ({"partitions": 2, "bf16": True}, 2, "'bf16': true is not supported by this implementation; train in bfloat16"),
    ({"partitions": 2, "fp16": True}, 2, "'fp16': true is not supported by this implementation; train in half"),
    ({"partitions": 2, "fp16": "yes"}, 2, "'fp16' must be true or false"),
])
def test_bad_configuration_is_refused_with_the_key_named(config, world, fragment):
    with pytest.raises(ConfigError) as e:
        resolve(config, world, environ={})
    assert fragment in str(e.value)


@pytest.mark.parametrize("raw, cap", [("", 0), ("0", 0), ("1", 1), (" 3 ", 3), ("-1", None), ("two", None)])
def test_the_pipeline_links_cta_cap_is_read_from_the_table_and_bad_values_are_named(monkeypatch, raw, cap):
    """SMDDP_SMP_P2P_MAX_CTAS, read in smp.init before any communication."""
    from smdistributed.modelparallel.torch.state import _p2p_max_ctas
    monkeypatch.setenv("SMDDP_SMP_P2P_MAX_CTAS", raw)
    if cap is None:
        with pytest.raises(ValueError, match=f"SMDDP_SMP_P2P_MAX_CTAS must be 0 .* got '{raw}'"):
            _p2p_max_ctas()
    else:
        assert _p2p_max_ctas() == cap


def test_bad_sagemaker_json_is_named():
    with pytest.raises(ConfigError, match="SM_HP_MP_PARAMETERS is not valid JSON"):
        resolve({"partitions": 2}, 2, environ={"SM_HP_MP_PARAMETERS": "{partitions: 2"})


# -- layout ----------------------------------------------------------------------------------------
def test_placement_strategies_lay_ranks_out_as_the_original():
    cluster = [Topology(r, 8, 2, "cluster") for r in range(8)]
    assert [t.pp_group for t in cluster][:4] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert cluster[3].dp_group == [1, 3, 5, 7] and (cluster[3].pp_rank, cluster[3].dp_rank) == (1, 1)
    spread = [Topology(r, 8, 2, "spread") for r in range(8)]
    assert spread[0].pp_group == [0, 4] and spread[5].pp_group == [1, 5]
    assert spread[5].dp_group == [4, 5, 6, 7] and (spread[5].pp_rank, spread[5].dp_rank) == (1, 1)


# -- partition ---------------------------------------------------------------------------------------
def test_linear_partition_minimises_the_largest_run():
    assert _linear_partition([1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 4]
    assert _linear_partition([4, 1, 1, 1, 1], 2) == [0, 1]
    assert _linear_partition([1, 2, 3], 3) == [0, 1, 2]
    starts = _linear_partition([1.0], 3)  # fewer units than partitions: some stay empty
    assert len(starts) == 3


def test_auto_partition_balances_a_layer_stack_and_keeps_the_root_on_its_first_unit():
    stack = nn.Sequential(*[nn.Linear(32, 32) for _ in range(16)])
    with Tracer(stack, timed=False) as tracer:
        stack(torch.randn(4, 32))
    a = auto_assignment(stack, tracer.trace, 2, 0.2)
    assert [a[str(i)] for i in range(16)] == [0] * 8 + [1] * 8
    assert a[""] == 0


def test_auto_partition_weighs_heavy_modules():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
            self.big = nn.Linear(8, 2048)
            self.out = nn.Linear(2048, 4)

        def forward(self, x):
            for m in self.small:
                x = m(x)
            return self.out(self.big(x))

    net = Net()
    with Tracer(net, timed=False) as tracer:
        net(torch.randn(2, 8))
    a = auto_assignment(net, tracer.trace, 2, 0.2)
    assert a["small"] == 0 and a["out"] == 1


def test_auto_partition_splits_the_blocks_of_a_module_list_the_forward_loops_over():
    """GPT-2's layout: embeddings, blocks in a ModuleList (never called itself: the forward
    loops over it), a final norm and head. The blocks are units of their own, split between
    partitions in call order, not kept whole on the first partition."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 64)
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    net = Net()
    with Tracer(net, timed=False) as tracer:
        net(torch.randn(2, 4))
    a = auto_assignment(net, tracer.trace, 2, 0.2)
    parts = [a[f"blocks.{i}"] for i in range(8)]
    assert parts == sorted(parts) and parts[0] == 0 and parts[-1] == 1, parts
    assert a["embed"] == 0 and a["head"] == 1


# -- microbatches ----------------------------------------------------------------------------------
def test_trace_memory_usage_counts_what_the_backward_saves():
    """DistributedModel(trace_memory_usage=True): each module's memory in the trace also counts
    the tensors autograd saves for its backward (parameters excepted), once per storage."""

    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)  # saves its output

    net = nn.Sequential(nn.Linear(8, 32), Exp(), nn.Linear(32, 4))
    x = torch.randn(5, 8)
    with torch.no_grad(), Tracer(net, timed=False) as plain:
        net(x)
    with torch.enable_grad(), Tracer(net, timed=False, measure_saved=True) as measured:
        net(x)
    added = {k: measured.trace.memory[k] - plain.trace.memory[k] for k in plain.trace.memory}
    # The first Linear saves its input (5 x 8 floats) for its weight's gradient; exp its output
    # and the last Linear its input, the same 5 x 32 floats (counted for each module).
    assert added == {"0": 5 * 8 * 4, "1": 5 * 32 * 4, "2": 5 * 32 * 4, "": (5 * 8 + 2 * 5 * 32) * 4}, added


def test_split_follows_nesting_axes_and_non_split_inputs():
    class Sliced:
        def __init__(self, v):
            self.v = v

        def smp_slice(self, num_mb, mb, axis):
            return Sliced(self.v[mb::num_mb])

    def fn(x, extra, mask, obj, scale=1.0):
        return x

    x = torch.arange(12).reshape(6, 2)
    mbs = split_arguments(fn, (x, {"a": [x, x * 2]}, torch.ones(3, 6), Sliced(list(range(6)))), {"scale": 2.0},
                          3, non_split=["obj"], axes={"mask": 1})
    assert len(mbs) == 3
    args, kwargs = mbs[1]
    assert torch.equal(args[0], x[2:4]) and torch.equal(args[1]["a"][1], 2 * x[2:4])
    assert args[2].shape == (3, 2) and isinstance(args[3], Sliced) and args[3].v == list(range(6))
    assert tuple(args[4:]) + tuple(kwargs.values()) == (2.0,)  # scale, passed through whole
    with pytest.raises(ValueError, match="6 samples along axis 0, which 4 microbatches do not divide"):
        split_arguments(fn, (x, {}, torch.ones(3, 8), None), {}, 4, [], {})


def test_a_mapping_that_is_not_a_dict_is_split_and_keeps_its_type():
    from collections import UserDict, defaultdict
    from collections.abc import MutableMapping

    class Encoding(UserDict):  # as Hugging Face's BatchEncoding: a UserDict with more state
        encodings = "kept"

    def fn(batch):
        return batch

    x = torch.arange(12).reshape(6, 2)
    mbs = split_arguments(fn, (Encoding(input_ids=x, attention_mask=x > 3),), {}, 3, [], {})
    (batch,), _ = mbs[2]
    assert type(batch) is Encoding and batch.encodings == "kept"
    assert torch.equal(batch["input_ids"], x[4:]) and torch.equal(batch["attention_mask"], x[4:] > 3)

    class Store(MutableMapping):  # keeps its items in an attribute; copy.copy would share them
        def __init__(self, items=()):
            self.items_ = dict(items)

        def __getitem__(self, k):
            return self.items_[k]

        def __setitem__(self, k, v):
            self.items_[k] = v

        def __delitem__(self, k):
            del self.items_[k]

        def __iter__(self):
            return iter(self.items_)

        def __len__(self):
            return len(self.items_)

    store = Store({"a": x})
    parts = [args[0] for args, _ in split_arguments(fn, (store,), {}, 2, [], {})]
    assert [type(p) for p in parts] == [Store, Store] and torch.equal(store["a"], x)  # the batch untouched
    assert torch.equal(parts[0]["a"], x[:3]) and torch.equal(parts[1]["a"], x[3:])
    counts = defaultdict(int, a=x)
    part = split_arguments(fn, (counts,), {}, 2, [], {})[1][0][0]
    assert type(part) is defaultdict and part.default_factory is int and torch.equal(part["a"], x[3:])


def test_step_output_reductions():
    out = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    assert torch.equal(out.reduce_mean(), torch.tensor([2.0, 4.0]))
    assert torch.equal(out.reduce_sum(), torch.tensor([4.0, 8.0]))
    assert out.concat().shape == (4,) and out.stack().shape == (2, 2)


def _holders(token, tasks, start_after=None):
    """Runs each (name, priority) task on its own thread: take the token, note the name, give it
    back. Returns the names in the order they held it."""
    order, threads = [], []

    def run(name, prio):
        token.acquire(prio)
        order.append(name)
        token.release()

    for name, prio in tasks:
        t = threading.Thread(target=run, args=(name, prio))
        t.start()
        threads.append(t)
        time.sleep(0.05)  # each queued before the next starts
    if start_after is not None:
        start_after()
    return order, threads


def test_grad_scaler_takes_torch_cuda_amps_positional_init_scale_and_tensor_parallel_names_are_explained():
    """smp.amp.GradScaler(1024.0), as scripts written for torch.cuda.amp.GradScaler call it: the
    number is the initial scale, not a device. The original's tensor-parallel API is named as
    unsupported rather than missing."""
    scaler = smp.amp.GradScaler(1024.0, 3.0)
    assert (scaler._init_scale, scaler._growth_factor) == (1024.0, 3.0)
    assert smp.amp.GradScaler("cpu", init_scale=8.0)._init_scale == 8.0
    with pytest.raises(AttributeError, match="tensor parallelism is not supported"):
        smp.tensor_parallelism  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'not_an_api'"):
        smp.not_an_api  # noqa: B018


def test_smp_nn_fused_layer_norm_is_torchs_layer_norm_under_apexs_signature():
    torch.manual_seed(3)
    fused, plain = smp.nn.FusedLayerNorm(12, 1e-6, memory_efficient=True), nn.LayerNorm(12, eps=1e-6)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(4, 12)
    assert torch.equal(fused(x), plain(x))
    with pytest.raises(AttributeError, match="tensor parallelism is not supported"):
        smp.nn.DistributedTransformerLMHead  # noqa: B018


def _lamb_by_hand(values, grads_per_step, groups, lr, betas, eps, max_norm, adam_w, nvlamb):
    """apex FusedLAMB's rule in float64, one tensor at a time: `groups[i]` is tensor i's
    weight decay; the clip divides by the norm over every tensor's gradient."""
    b1, b2 = betas
    p = [v.double().clone() for v in values]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, 1):
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        divisor = max(norm.item() / max_norm, 1.0)
        for i, wd in enumerate(groups):
            g = grads[i].double() / divisor
            if not adam_w:
                g = g + wd * p[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1 ** t)) / (torch.sqrt(v[i] / (1 - b2 ** t)) + eps)
            if adam_w:
                u = u + wd * p[i]
            rate = lr
            if (nvlamb or wd != 0) and p[i].norm() > 0 and u.norm() > 0:
                rate = lr * (p[i].norm() / u.norm()).item()
            p[i] = p[i] - rate * u
    return p


@pytest.mark.parametrize("adam_w, nvlamb", [(True, False), (False, False), (True, True)])
def test_fused_lamb_makes_apexs_update(adam_w, nvlamb):
    """smp.optimizers.FusedLamb against LAMB written out by hand: two parameter groups (one
    without weight decay), gradients large enough to be clipped by their joint norm."""
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(3, 4, generator=g), torch.randn(4, generator=g)]
    grads = [[torch.randn(3, 4, generator=g) * 3, torch.randn(4, generator=g) * 3] for _ in range(3)]
    params = [nn.Parameter(x.clone()) for x in values]
    opt = smp.optimizers.FusedLamb([{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]],
                                    "weight_decay": 0.0}], lr=0.05, max_grad_norm=2.0, adam_w_mode=adam_w,
                                   use_nvlamb=nvlamb)
    for step in grads:
        for prm, gr in zip(params, step):
            prm.grad = gr.clone()
        opt.step()
    expected = _lamb_by_hand(values, grads, [0.1, 0.0], 0.05, (0.9, 0.999), 1e-6, 2.0, adam_w, nvlamb)
    for prm, want in zip(params, expected):
        assert torch.allclose(prm.double(), want, rtol=1e-5, atol=1e-6), (prm, want)
    opt.zero_grad()
    assert all(prm.grad is None for prm in params)  # set_grad_none, as apex's


def _novograd_by_hand(values, grads_per_step, decays, lr, betas, eps, inside, averaging, norm_type, init_zero,
                      correct):
    """apex FusedNovoGrad's rule in float64, one tensor at a time (`decays[i]` is tensor i's
    weight decay): the second moment is a running norm of each whole gradient."""
    b1, b2 = betas
    p = [x.double().clone() for x in values]
    m = [torch.zeros_like(x) for x in p]
    v = [None] * len(p)
    for t, grads in enumerate(grads_per_step, 1):
        c1, c2 = (1 - b1 ** t, (1 - b2 ** t) ** 0.5) if correct else (1.0, 1.0)
        b3 = 1 - b1 if averaging else 1.0
        for i, wd in enumerate(decays):
            g = grads[i].double()
            n = g.norm().item() if norm_type == 2 else g.abs().max().item()
            if v[i] is None:
                v[i] = 0.0 if init_zero else n
            v[i] = (b2 * v[i] ** 2 + (1 - b2) * n ** 2) ** 0.5 if norm_type == 2 else b2 * v[i] + (1 - b2) * n
            denom = v[i] / c2 + eps
            if inside:
                m[i] = b1 * m[i] + b3 * (g / denom + wd * p[i])
                p[i] = p[i] - lr * m[i] / c1
            else:
                m[i] = b1 * m[i] + b3 * g
                p[i] = p[i] - lr * ((m[i] / c1) / denom + wd * p[i])
    return p


NOVOGRAD_CASES = [dict(), dict(reg_inside_moment=True), dict(norm_type=0), dict(init_zero=True),
                  dict(grad_averaging=False, bias_correction=False)]


@pytest.mark.parametrize("options", NOVOGRAD_CASES, ids=["default", "inside", "inf-norm", "init-zero", "plain"])
def test_fused_novograd_makes_apexs_update(options):
    """smp.optimizers.FusedNovoGrad against NovoGrad written out by hand: two parameter groups
    (one without weight decay), a float32 and a bfloat16 tensor, and each option of apex's."""
    g = torch.Generator().manual_seed(6)
    values = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(3, 4, generator=g) * (t + 1), torch.randn(5, generator=g)] for t in range(4)]
    params = [nn.Parameter(x.clone()) for x in values]
    opt = smp.optimizers.FusedNovoGrad([{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]]}],
                                       lr=0.05, **options)
    for step in grads:
        for prm, gr in zip(params, step):
            prm.grad = gr.clone()
        opt.step()
    expected = _novograd_by_hand(values, grads, [0.1, 0.0], 0.05, (0.9, 0.999), 1e-8,
                                 options.get("reg_inside_moment", False), options.get("grad_averaging", True),
                                 options.get("norm_type", 2), options.get("init_zero", False),
                                 options.get("bias_correction", True))
    for prm, want in zip(params, expected):
        assert torch.allclose(prm.double(), want, rtol=1e-5, atol=1e-6), (prm, want)
    opt.zero_grad()
    assert all(prm.grad is None for prm in params)  # set_grad_none, as apex's
    # The saved state carries the per-tensor norms, so a reloaded optimizer goes on identically.
    again = [nn.Parameter(prm.detach().clone()) for prm in params]
    resumed = smp.optimizers.FusedNovoGrad([{"params": [again[0]], "weight_decay": 0.1}, {"params": [again[1]]}],
                                           lr=0.05, **options)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: torch would share the tensors
    for o, ps in ((opt, params), (resumed, again)):
        for prm, gr in zip(ps, grads[0]):
            prm.grad = gr.clone()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, again))
    # bfloat16: computed in float32, stored in bf16 (a learning rate whose steps bf16 can see).
    bf16 = nn.Parameter(values[0].bfloat16())
    bf16.grad = grads[0][0].bfloat16()
    smp.optimizers.FusedNovoGrad([bf16], lr=20.0).step()
    start = values[0].bfloat16().double()
    want = _novograd_by_hand([start], [[grads[0][0].bfloat16()]], [0.0], 20.0, (0.9, 0.999), 1e-8,
                             False, True, 2, False, True)[0]
    assert (want - start).abs().mean() > 10 * 2 ** -8 * start.abs().mean()  # the step is well above rounding
    assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.double(), want, rtol=2 ** -8, atol=1e-6)
    # A reload keeps a bf16 parameter's norm in float32 (torch casts state to the parameter's dtype).
    pair = [nn.Parameter(values[1].bfloat16()) for _ in range(2)]
    first = smp.optimizers.FusedNovoGrad([pair[0]], lr=5.0)
    for gr in grads[:2]:
        pair[0].grad = gr[1].bfloat16()
        first.step()
    pair[1].data.copy_(pair[0].data)
    second = smp.optimizers.FusedNovoGrad([pair[1]], lr=5.0)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    assert second.state[pair[1]]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(second.state[pair[1]]["exp_avg_sq"], first.state[pair[0]]["exp_avg_sq"])
    for o, prm in ((first, pair[0]), (second, pair[1])):
        prm.grad = grads[2][1].bfloat16()
        o.step()
    assert torch.equal(pair[0], pair[1])
    with pytest.raises(ValueError, match="norm_type must be 2"):
        smp.optimizers.FusedNovoGrad(params, norm_type=1)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        smp.optimizers.FusedNovoGrad(params, amsgrad=True)


def test_a_graphed_runs_fingerprint_changes_with_whatever_its_capture_took_as_fixed():
    """A captured run is replayed only while its fingerprint is unchanged; a stale graph would
    train the old parameters or the old mode. Every change a capture cannot follow changes it:
    a submodule's mode, a parameter's requires_grad or tensor, a replaced submodule or buffer.
    The same modules give the same fingerprint."""
    run = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2)]
    fp = StageGraphs._fingerprint
    base = fp(run)
    assert fp(run) == base
    run[0].eval()
    assert fp(run) != base
    run[0].train()
    assert fp(run) == base
    run[1].weight.requires_grad_(False)
    assert fp(run) != base
    run[1].weight.requires_grad_(True)
    run[1].weight.data = run[1].weight.data.clone()
    moved = fp(run)
    assert moved != base
    run[0][1].running_mean = torch.zeros(4)
    assert fp(run) != moved
    before = fp(run)
    run[0][0] = nn.Linear(4, 4)
    assert fp(run) != before
    # The activation-checkpointing mark, read from the module's own dict on every module call.
    assert checkpoint_options(run[1]) is None
    smp.set_activation_checkpointing(run[1])
    assert checkpoint_options(run[1]) == {"preserve_rng_state": True}


def test_a_graphed_runs_kept_view_sees_every_change_the_full_walk_sees():
    """The view StageGraphs keeps of a run (run_view.py) is checked at every call, and must
    give what a fresh walk of the modules gives after any change: a submodule replaced or
    removed deep inside, a parameter or buffer replaced or deleted, a mode, a hook, an
    activation-checkpointing mark."""
    graphs = StageGraphs(enabled=False)
    inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    run = [nn.Sequential(inner, nn.ReLU()), nn.Linear(4, 2)]
    run_id = ("m", 0, 2)

    def agrees():
        view = graphs.view(run_id, run)
        fresh = RunView(run)
        assert view.fingerprint() == fresh.fingerprint() == StageGraphs._fingerprint(run)
        assert view.hooked_or_checkpointed() == fresh.hooked_or_checkpointed()
        return view.fingerprint(), view.hooked_or_checkpointed()

    base = agrees()
    assert graphs.view(run_id, run) is graphs.view(run_id, run)  # unchanged: not walked again
    assert agrees() == base
    changes = [
        lambda: inner.__setitem__(0, nn.Linear(4, 4)),  # a submodule deep inside, replaced
        lambda: setattr(inner[1], "running_var", torch.ones(4)),  # a buffer replaced
        lambda: setattr(run[1], "bias", nn.Parameter(torch.zeros(2))),  # a parameter replaced
        lambda: inner[0].weight.requires_grad_(False),
        lambda: setattr(inner[0].weight, "data", inner[0].weight.data.clone()),
        lambda: inner[1].eval(),
        lambda: delattr(run[1], "bias"),  # a parameter deleted
        lambda: inner.add_module("extra", nn.Linear(4, 4)),  # a submodule added
        lambda: delattr(inner, "extra"),
    ]
    before = base[0]
    for change in changes:
        change()
        now, hooked = agrees()
        assert now != before and not hooked
        before = now
    handle = inner[0].register_forward_hook(lambda *a: None)
    assert agrees()[1]
    handle.remove()
    assert not agrees()[1]
    # Dicts replaced wholesale are read as they are now: hooks swapped out and back, a new
    # parameter dict, a Sequential whose children dict was rebuilt.
    handle = run[1].register_forward_pre_hook(lambda *a: None)
    hooks, run[1]._forward_pre_hooks = run[1]._forward_pre_hooks, type(run[1]._forward_pre_hooks)()
    assert not agrees()[1]
    run[1]._forward_pre_hooks = hooks
    assert agrees()[1]
    handle.remove()
    before = agrees()[0]
    run[1]._parameters = {"weight": nn.Parameter(torch.ones(2, 4))}
    assert agrees()[0] != before
    before = agrees()[0]
    del inner[1:1]  # rebuilds the children dict, unchanged
    assert agrees()[0] == before
    inner.append(nn.Linear(4, 4))
    assert agrees()[0] != before

    class Alike(nn.Linear):  # equal to any other Alike: children compare by identity
        def __eq__(self, other):
            return isinstance(other, Alike)
        __hash__ = nn.Module.__hash__
    inner[0] = Alike(4, 4)
    before = agrees()[0]
    inner[0] = Alike(4, 4)
    assert agrees()[0] != before
    smp.set_activation_checkpointing(inner[1])
    assert agrees()[1]


def test_small_cpu_messages_travel_inside_their_header():
    """A message whose meta and CPU tensors fit in the header is one send: its tensors come back
    from the header bit for bit, in every dtype (bool, bfloat16, complex, a strided view, an
    empty tensor); one that does not fit keeps the header for its meta alone."""
    import pickle

    from smdistributed.modelparallel.torch import wire

    def roundtrip(tensors):
        meta, sent, _ = wire.encode(wire.Message("fwd", {"id": (0, 1, 2)}, {"x": tensors}))
        header, _, packed = wire.header_for(meta, sent)
        n = int.from_bytes(header.numpy().tobytes()[:8], "little")
        assert bool(n & wire._PACKED) == packed
        n &= ~wire._PACKED
        specs = pickle.loads(header.numpy().tobytes()[8:8 + n])[0]
        return packed, (wire._unpack(header, 8 + n, specs) if packed else None)

    small = [torch.randn(3, 4), torch.tensor(True), torch.randn(5, dtype=torch.complex64),
             torch.randn(2, 3).bfloat16(), torch.arange(6).view(2, 3)[:, 1:], torch.empty(0, 3),
             torch.randn(2, 2, requires_grad=True)]
    packed, got = roundtrip(small)
    assert packed
    for want, have in zip(small, got):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want.detach())
    assert not roundtrip([torch.randn(1024)])[0]  # 4 KB of data and a meta: past the header
    for spec in [wire.TensorSpec((2,), torch.float32, False, False),  # 8 bytes where 4 are left
                 wire.TensorSpec((1 << 40, 1 << 20), torch.float32, False, False)]:  # refused before allocating
        with pytest.raises(RuntimeError, match="claims more tensor data"):
            wire._unpack(torch.zeros(wire.HEADER_BYTES, dtype=torch.uint8), wire.HEADER_BYTES - 4, [spec])


def test_taking_a_received_message_with_no_cuda_tensors_touches_no_stream():
    """A merged answer (the root's copy of the output and the input gradients, one message) is
    delivered in two halves that share its CUDA receive event; the gradients' half carries no
    tensor when the last stage's input needs no gradient (a frozen first stage). Taking it
    must not ask for a stream (it raised IndexError)."""
    class Event:
        waited = False

        def wait(self, stream=None):
            Event.waited = True
    take([], Event())
    take([torch.zeros(2)], Event())
    assert not Event.waited


class _Replayed:
    """What the step accumulator reads of a graphed instance: its run's parameters, the run's
    gradient buffers, and which parameters its backward reaches."""

    def __init__(self, params, buffers, used):
        self.params, self.param_grad_out, self.used, self.used_set = params, buffers, used, frozenset(used)

    def replay(self, acc, grads):
        """One backward replay: what the graph does to the buffers, after acc.begin."""
        with acc.lock:
            acc.begin(self)
            for i in self.used:
                self.param_grad_out[i].add_(grads[i])


def test_graphed_gradients_gather_over_the_step_and_reach_grad_once():
    """The bookkeeping of graphed runs' gradients (stage_graphs._StepAccumulator), on CPU
    tensors: the buffers are zeroed at the step's first replay only, whatever they held; the
    flush adds the step's sum to .grad (a new .grad where there is none, an addition where the
    user kept one) and only for parameters a replay reached; a shape of the run that reaches
    more parameters zeroes those first; a discarded step adds nothing and the next starts
    from zero."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    buffers = [torch.full((3,), 7.0) for _ in params]  # stale contents: never read before a zeroing
    acc = _StepAccumulator()
    short = _Replayed(params, buffers, [0, 1])  # reaches parameters 0 and 1
    full = _Replayed(params, buffers, [0, 1, 2])
    g = [[torch.randn(3) for _ in params] for _ in range(4)]
    params[1].grad = torch.ones(3)  # kept from before the step (accumulation over steps)
    short.replay(acc, g[0])
    short.replay(acc, g[1])
    full.replay(acc, g[2])  # parameter 2 joins: zeroed first, then added to
    # Nothing reaches .grad before the flush.
    assert params[0].grad is None and params[2].grad is None and torch.equal(params[1].grad, torch.ones(3))
    acc.flush()
    assert torch.allclose(params[0].grad, g[0][0] + g[1][0] + g[2][0])
    assert torch.allclose(params[1].grad, 1 + g[0][1] + g[1][1] + g[2][1])
    assert torch.allclose(params[2].grad, g[2][2])
    acc.flush()  # nothing pending: nothing added twice
    assert torch.allclose(params[2].grad, g[2][2])
    # A step that failed: its replays are forgotten, the next step's first replay zeroes again.
    for p in params:
        p.grad = None
    short.replay(acc, g[3])
    acc.discard()
    short.replay(acc, g[0])
    acc.flush()
    assert torch.allclose(params[0].grad, g[0][0]) and params[2].grad is None


def test_the_compute_tokens_release_hook_runs_on_the_holder_before_anyone_else_computes():
    """The hook that frees a thread's cuBLAS workspaces on GPUs runs while the releasing thread
    still holds the token (so no other thread is mid-product), once per release by the
    holder, and never for a thread that does not hold it."""
    seen = []
    token = ComputeToken(lambda: None, on_release=lambda: seen.append(token._holder == threading.get_ident()))
    token.acquire((0, 0))
    order, threads = _holders(token, [("mb1", (1, 0))])
    token.release()
    threads[0].join(5)
    assert order == ["mb1"] and seen == [True, True], (order, seen)
    token.release()  # not the holder: nothing happens
    assert seen == [True, True]


def test_the_compute_token_waits_for_an_expected_older_task_then_gives_up_on_it():
    token = ComputeToken(lambda: None)
    # The holder hands a value to microbatch 0's thread, which is still waking up, and goes on
    # to newer work: the newer work waits until microbatch 0 has computed.
    token.acquire((0, 0))
    token.expect((0, 0), within=5.0)
    token.release()
    order, threads = _holders(token, [("mb1", (1, 0)), ("mb0", (0, 0))])
    for t in threads:
        t.join(5)
    assert order == ["mb0", "mb1"], order
    # An expected task that never asks holds the token back only for `within`, also from a
    # task that queued while it was held back and nobody releases it after.
    token.acquire((9, 0))
    token.expect((0, 0), within=0.1)
    order, threads = _holders(token, [("mb2", (2, 0))])
    began = time.perf_counter()
    token.release()
    threads[0].join(5)
    assert order == ["mb2"] and time.perf_counter() - began < 0.3, (order, time.perf_counter() - began)
    # Older work is never held back for a newer expected task.
    token.expect((5, 0), within=5.0)
    order, threads = _holders(token, [("mb3", (3, 0))])
    threads[0].join(5)
    assert order == ["mb3"] and token.older_work_waits((6, 0)) and not token.older_work_waits((4, 0))


def test_a_task_that_raises_is_reported_and_its_worker_takes_the_next_task():
    """An error escaping a pipeline task goes to the runtime (which fails the step) and leaves
    the worker alive: a dead worker, still listed idle, would take the next task and never run it."""
    pool = WorkerPool(torch.device("cpu"))
    escaped = []
    pool.on_task_error = escaped.append
    failing = pool.submit(lambda: 1 / 0)
    assert failing.join(5) and isinstance(failing.error, ZeroDivisionError) and escaped == [failing.error]
    ran = []
    after = pool.submit(ran.append, "next")
    assert after.join(5) and ran == ["next"] and after.error is None


def test_a_send_waiting_for_a_turn_that_never_comes_gives_up_when_the_step_fails():
    links = Links(None, [0, 1], 0, {}, torch.device("cpu"))
    links.reserve(1, "fwd")  # a turn whose send never happens (its work failed before sending)
    second = links.reserve(1, "fwd")
    failure = RuntimeError("microbatch 3's forward raised")
    outcome = []

    def send_second():
        try:
            with links._in_turn((1, "fwd"), second):
                outcome.append("sent")
        except RuntimeError as e:
            outcome.append(e)
    sender = threading.Thread(target=send_second)
    sender.start()
    time.sleep(0.6)
    assert outcome == []  # it waits for the first turn
    links.aborted = lambda: failure
    sender.join(3)
    assert outcome == [failure]


# -- pipelines of processes --------------------------------------------------------------------------
LAYOUTS = [(2, 2), (3, 3), (4, 2)]  # (processes, partitions): pp=2, pp=3, pp=2 x dp=2
CASES = [("skip", "manual", "simple"), ("skip", "manual", "interleaved"), ("skip", "auto", "simple"),
         ("seq", "auto", "simple"), ("seq", "auto", "interleaved"), ("seqparts", "manual", "interleaved"),
         ("resid", "manual", "interleaved")]


@pytest.mark.parametrize("procs, parts", LAYOUTS, ids=["pp2", "pp3", "pp2xdp2"])
@pytest.mark.parametrize("model, mode, pipeline", CASES, ids=["-".join(c) for c in CASES])
def test_pipeline_trains_like_one_process(procs, parts, model, mode, pipeline):
    _check_pipeline_trains_like_one_process(procs, parts, model, mode, pipeline)


# pp=4 (the 4-GPU layout, on CPU processes): the manual split leaves partition 2 without a module.
@pytest.mark.parametrize("model, mode, pipeline", [("skip", "manual", "interleaved"), ("seq", "auto", "simple")],
                         ids=["skip-manual-interleaved", "seq-auto-simple"])
def test_four_stage_pipeline_trains_like_one_process(model, mode, pipeline):
    _check_pipeline_trains_like_one_process(4, 4, model, mode, pipeline)


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_a_root_on_the_last_partition_and_nested_partition_contexts_train_like_one_process(pipeline):
    """default_partition 1: the root module (and so each microbatch's forward) runs on pipeline
    rank 1, not rank 0; the gate is made in smp.partition(1) inside smp.partition(0) and lands
    on partition 1 (the innermost context wins)."""
    results = run_world(2, "smp_pipeline.py", ["skip", "manual", pipeline, "2", "4", "3"], timeout=120,
                        env={"SMP_TEST_DEFAULT_PARTITION": "1", "SMP_TEST_NESTED": "1"})
    assert_all_ok(results)
    reports = {r.event("trained")["pp_rank"]: r.event("trained") for r in results}
    assert {"gate.weight", "head.weight"} <= set(reports[1]["local"]), reports[1]["local"]
    assert "gate.weight" not in reports[0]["local"] and "embed.weight" in reports[0]["local"]
    for r in reports.values():
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r


def _compute_spans(prefix, rank):
    """(start, end, kind, phase, "mbN") of each span in which a task held the compute token."""
    events = json.loads(Path(f"{prefix}.smp.rank{rank}.json").read_text())["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"], *e["name"].split())
                  for e in events if e["cat"] == "compute" and e["name"])


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_the_schedules_run_forwards_and_backwards_in_their_documented_order(pipeline, tmp_path):
    """From each rank's timeline (the spans in which a task holds the compute token), one step
    of 6 microbatches: "simple" runs every forward before any backward; "interleaved" with
    active_microbatches 2 never has more than 2 microbatches between their first forward and
    their last backward, so backwards run between forwards; and the last stage goes from a
    microbatch's loss into its backward without running another's forward between (which held
    that forward's activations at the stage's peak)."""
    prefix = tmp_path / "tl"
    results = run_world(2, "smp_pipeline.py", ["seq", "auto", pipeline, "2", "6", "1", "2"], timeout=120,
                        env={"SMDDP_TIMELINE": str(prefix)})
    assert_all_ok(results)
    for rank in range(2):
        spans = _compute_spans(prefix, rank)
        # A non-root rank starts every microbatch's step function at once, to wait there for
        # the root's output: its work on a microbatch starts when it serves the root's call.
        starts = "serve" if any(kind == "serve" for _, _, kind, _, _ in spans) else "step"
        fwd = [(s, e, int(mb[2:])) for s, e, kind, phase, mb in spans if phase == "fwd" and kind == starts]
        bwd = [(s, e, int(mb[2:])) for s, e, kind, phase, mb in spans if phase == "bwd"]
        assert {mb for *_, mb in fwd} == {mb for *_, mb in bwd} == set(range(6)), spans
        if pipeline == "simple":
            assert max(e for _, e, _ in fwd) <= min(s for s, _, _ in bwd), spans
            continue
        live = {mb: (min(s for s, _, m in fwd if m == mb), max(e for _, e, m in bwd if m == mb)) for mb in range(6)}
        for t, _ in live.values():  # at each microbatch's start, who is in flight
            assert sum(1 for a, b in live.values() if a <= t < b) <= 2, (rank, live)
        assert min(s for s, _, _ in bwd) < max(s for s, _, _ in fwd), spans
        if rank == 1:  # the last stage: no later microbatch's work between a loss and its backward
            for mb in range(6):
                first = min(i for i, (_, _, kind, phase, m) in enumerate(spans)
                            if (kind, phase, m) == ("step", "bwd", f"mb{mb}"))
                loss = max(i for i, (_, _, kind, phase, m) in enumerate(spans[:first])
                           if (kind, phase, m) == ("step", "fwd", f"mb{mb}"))
                between = [sp for sp in spans[loss + 1:first] if int(sp[4][2:]) > mb]
                assert not between, (mb, spans[loss:first + 1])


@pytest.mark.parametrize("model, mode, env, windows", [
    ("seq", "auto", {}, [3, 2, 1]),
    ("seq", "auto", {"SMDDP_SMP_OUTPUT_BACKWARD": "0"}, [3, 2, 2]),
    # Through partitions 1, 2, 3 and back to 0 (the root computes the loss): by depth, one more
    # than 1F1B's for the round trip; stage 1's 4 is the root's own bound.
    ("bounce", "manual", {}, [4, 3, 2]),
], ids=["last-stage-loss", "root-loss", "round-trip-by-depth"])
def test_each_stage_holds_no_more_microbatches_than_1f1b(model, mode, env, windows, tmp_path):
    """pp=4, 8 microbatches, 4 active: stage k (k > 0) holds at most 4 - k microbatches
    between a microbatch's forward there and the end of its backward there, as torch's 1F1B
    does (one more on the last stage when the root computes the loss; one more on each stage
    reached d-th by a layout that is not a rank-ordered Sequential), where every stage could
    otherwise hold all 4 the root admits; and the pipeline trains as one process."""
    prefix = tmp_path / "tl"
    results = run_world(4, "smp_pipeline.py", [model, mode, "interleaved", "4", "8", "2", "4"], timeout=120,
                        env={"SMDDP_TIMELINE": str(prefix), **env})
    assert_all_ok(results)
    for r in (r.event("trained") for r in results):
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["kept_after_steps"] == [], r["kept_after_steps"]
    for rank in range(1, 4):
        window = windows[rank - 1]
        held = []  # [mb, its forward's start here, its backward's end here]
        current = {}
        for start, end, kind, phase, mb in _compute_spans(prefix, rank):
            if kind == "serve" and phase == "fwd" and (mb not in current or current[mb][2] is not None):
                current[mb] = [mb, start, None]  # a new step's forward of this microbatch
                held.append(current[mb])
            elif phase == "bwd" and current[mb][2] is None:  # its backward (the step function goes on later)
                current[mb][2] = end
        assert len(held) == 2 * 8 and all(end is not None for _, _, end in held), (rank, held)
        most = max(sum(1 for _, a, b in held if a <= t < b) for _, t, _ in held)
        assert most <= window, (rank, most, held)


def _check_pipeline_trains_like_one_process(procs, parts, model, mode, pipeline):
    results = run_world(procs, "smp_pipeline.py", [model, mode, pipeline, str(parts), "4", "5"], timeout=120)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    owned = [set(r["local"]) for r in reports if r["dp_rank"] == 0]
    assert set().union(*owned) and sum(len(o) for o in owned) == len(set().union(*owned)), owned
    if mode == "manual" or model == "skip":
        assert sum(1 for o in owned if o) >= 2, f"the model was not split: {owned}"
    for r in reports:
        assert r["keys_match"], r
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"
        # Nothing of a finished step stays alive (idle pipeline threads kept their last task's
        # microbatch, and with it the tensors of its graph).
        assert r["kept_after_steps"] == [], r["kept_after_steps"]
    # A Sequential root: the last stage starts every microbatch's backward from its own loss
    # (5 steps x 4 microbatches); a custom forward (skip) keeps the root's round trip.
    last = {r["pp_rank"]: r["output_backwards"] for r in reports}
    sequential = model in ("seq", "seqparts")
    assert last == ({p: (20 if p == parts - 1 else 0) for p in range(parts)} if sequential
                    else {p: 0 for p in range(parts)}), last
    # Only the rank that starts the backward keeps a graph on its copy of the loss: the root's
    # copy of an output whose owner starts the backward is plain data (it held the loss's graph
    # and ran a backward of it that went nowhere).
    graphs = {r["pp_rank"]: r["loss_graphs"] for r in reports}
    starter = parts - 1 if sequential else 0
    assert graphs == {p: (20 if p == starter else 0) for p in range(parts)}, graphs


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_last_stage_gradients_can_reach_the_root_before_its_answer(pipeline):
    """The last stage hands its own copy of the model output to its step function before it
    sends the root its answer (runtime._serve), so a call's input gradients can reach the root
    before the call's answer. With every answer held back 0.2 s (SMP_TEST_SLOW_ANSWERS, the
    real transport), they do, and training still equals one process."""
    results = run_world(2, "smp_pipeline.py", ["seqparts", "manual", pipeline, "2", "4", "2"],
                        env={"SMP_TEST_SLOW_ANSWERS": "0.2", "SMDDP_SMP_HOLD_ANSWER_MS": "0"}, timeout=120)
    assert_all_ok(results)
    reports = {r.event("trained")["pp_rank"]: r.event("trained") for r in results}
    for r in reports.values():
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"
    assert reports[1]["output_backwards"] == 2 * 4, reports[1]
    assert reports[1]["gradients_before_answer"] > 0, reports[1]
    assert reports[0]["gradients_before_answer"] == 0, reports[0]


@pytest.mark.parametrize("procs, parts, pipeline, env, merged, model", [
    (2, 2, "interleaved", {}, {1: 12}, "seqparts"),
    (4, 2, "interleaved", {}, {1: 12}, "seqparts"),
    (3, 3, "interleaved", {"SMDDP_SMP_CHAIN_CALLS": "0"}, {2: 12}, "seqparts"),
    (3, 3, "interleaved", {}, {}, "seqparts"),
    (2, 2, "simple", {}, {}, "seqparts"),
    (2, 2, "interleaved", {"SMDDP_SMP_HOLD_ANSWER_MS": "0"}, {}, "seqparts"),
    (2, 2, "interleaved", {"SMDDP_SMP_HOLD_ANSWER_MS": "2"}, None, "seqparts"),
    (2, 2, "interleaved", {}, {1: 12}, "seqfrozen"),
    (2, 2, "interleaved", {"SMDDP_SMP_INLINE_OUTPUT": "0"}, {1: 12}, "seqparts"),
], ids=["pp2", "pp2xdp2", "pp3-unchained", "pp3-chained", "simple", "knob-off", "short-hold", "frozen-first-stage",
        "served-by-a-runner"])
def test_the_last_stage_sends_its_answer_with_the_input_gradients(procs, parts, pipeline, env, merged, model):
    """Under "interleaved" the last stage holds each answer to the root (the root's copy of the
    model output) until its backward and sends it in the input gradients' message: one
    message a microbatch instead of two (held_answers.py); 3 steps x 4 microbatches here. The
    hold is 10 s, so an answer that missed its backward would show as a late one (or a step
    10 s long). Nothing is held under "simple", by a chain's last hop (its gradients go to the
    previous hop, not the root), or with the knob at 0. With a 2 ms hold the flusher and the
    backward race for each answer: every answer leaves once, one way or the other. With the
    first stage frozen, the merged message carries the answer and no gradient. Wherever
    answers are held, the last stage's step function serves the call that makes its own
    output (SMDDP_SMP_INLINE_OUTPUT; a serve runner with the knob at 0). Training equals one
    process in every case."""
    env = {"SMDDP_SMP_HOLD_ANSWER_MS": "10000", **env}
    results = run_world(procs, "smp_pipeline.py", [model, "manual", pipeline, str(parts), "4", "3"], env=env,
                        timeout=120)
    assert_all_ok(results)
    for r in (r.event("trained") for r in results):
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        if merged is None:  # the race: each of the last stage's answers went exactly one way
            assert r["merged_answers"] + r["late_answers"] == (12 if r["pp_rank"] == 1 else 0), r
        else:
            assert r["late_answers"] == 0, r
            assert r["merged_answers"] == merged.get(r["pp_rank"], 0), r
        holds = merged is None or bool(merged)
        inline = 12 if holds and r["pp_rank"] == parts - 1 and env.get("SMDDP_SMP_INLINE_OUTPUT") != "0" else 0
        assert r["inline_output_serves"] == inline, r


@pytest.mark.parametrize("case, env", [
    ("second-call", {"SMP_TEST_SECOND_CALL": "1", "SMP_TEST_EVAL_STEP": "1", "SMDDP_SMP_HOLD_ANSWER_MS": "10000"}),
    ("waits-on-root", {"SMP_TEST_WAIT_ON_ROOT": "1", "SMDDP_SMP_HOLD_ANSWER_MS": "50"}),
])
def test_a_held_answer_leaves_alone_when_the_step_function_does_not_go_straight_to_backward(case, env):
    """What the last stage's step function may do between its model call and model.backward
    that needs the root's step function to have its answer first:
    - a second model call (the root makes it only once it has the first answer), and an
      evaluation step that ends without model.backward: the held answer leaves at once, alone
      (with a 10 s hold, a miss would cost 10 s a microbatch);
    - a wait smp cannot see (here on the c10d store, for the root's step function to pass its
      model call; a collective with the root is the same): the answer leaves alone after
      SMDDP_SMP_HOLD_ANSWER_MS instead of the step hanging.
    Training equals one process either way."""
    results = run_world(2, "smp_pipeline.py", ["seqparts", "manual", "interleaved", "2", "4", "3"], env=env,
                        timeout=120)
    assert_all_ok(results)
    reports = {r.event("trained")["pp_rank"]: r.event("trained") for r in results}
    for r in reports.values():
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["merged_answers"] == 0, r
    if case == "second-call":
        assert reports[1]["late_answers"] == 0, reports[1]
        assert reports[1]["eval_step_s"] < 5, reports[1]
    else:
        assert reports[1]["late_answers"] == 3 * 4, reports[1]


@pytest.mark.parametrize("procs, model, pipeline, env, hops", [
    (3, "seq", "interleaved", {}, [0, 20, 0]),
    (4, "seq", "simple", {}, [0, 20, 20, 0]),
    (3, "bounce", "simple", {}, [0, 20, 0]),
    (4, "bounce", "interleaved", {}, [0, 20, 20, 0]),
    (3, "seq", "interleaved", {"SMDDP_SMP_OUTPUT_BACKWARD": "0"}, [0, 20, 0]),
    (3, "seq", "simple", {"SMDDP_SMP_CHAIN_CALLS": "0"}, [0, 0, 0]),
    (3, "frozen", "interleaved", {}, [0, 20, 0]),
    (4, "frozen", "simple", {}, [0, 20, 20, 0]),
    (3, "cut", "interleaved", {}, [0, 20, 0]),
], ids=["seq-pp3", "seq-pp4", "bounce-pp3", "bounce-pp4", "seq-pp3-root-asks-backward", "seq-pp3-unchained",
        "frozen-pp3", "frozen-pp4", "cut-pp3"])
def test_chained_calls_send_activations_stage_to_stage_and_train_like_one_process(procs, model, pipeline, env,
                                                                                   hops):
    """Runs of a Sequential on partitions 1.. are one chained call: each hop sends its output
    straight to the next stage and its input gradients straight to the previous one (counted
    per rank: 5 steps x 4 microbatches). Covered: the last hop keeping the model output and
    starting the backward ("seq"), a chain whose result returns to the root, which then asks
    the last hop for the backward ("bounce", and "seq" with SMDDP_SMP_OUTPUT_BACKWARD=0), a
    frozen first hop whose successor gets no gradient-carrying input and so answers the root
    itself ("frozen"), a hop whose output carries no gradient, so the hop before it drops its
    frame at once ("cut": with 4 microbatches against stage 1's window of 3, a kept frame
    held its place for good and the step hung), and the knob off (every run a round trip
    through the root)."""
    mode = "auto" if model == "seq" else "manual"
    results = run_world(procs, "smp_pipeline.py", [model, mode, pipeline, str(procs), "4", "5"], timeout=120,
                        env=env)
    assert_all_ok(results)
    reports = sorted((r.event("trained") for r in results), key=lambda r: r["pp_rank"])
    for r in reports:
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"
        assert r["kept_after_steps"] == [], r["kept_after_steps"]
    assert [r["chained_hops"] for r in reports] == hops, [r["chained_hops"] for r in reports]


def test_encoder_stack_pipeline_trains_like_one_process_with_the_graph_knob_inert_on_cpu():
    """A Sequential of transformer encoder layers split over 2 processes trains as one process
    does; SMDDP_SMP_CUDA_GRAPHS=1 changes nothing on CPU (graphs need a CUDA stage: every run
    is eager). tests/test_cuda.py checks the graphs themselves."""
    results = run_world(2, "smp_pipeline.py", ["enc", "auto", "interleaved", "2", "4", "3"], timeout=120,
                        env={"SMDDP_SMP_CUDA_GRAPHS": "1"})
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    for r in reports:
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["kept_after_steps"] == [], r["kept_after_steps"]
        assert not any(r["graphs"].values()), r["graphs"]  # not even tried: the stage is not on CUDA


@pytest.mark.parametrize("procs, parts", [(2, 2), (3, 3)], ids=["pp2", "pp3"])
def test_more_microbatches_than_may_be_active_train_like_one_process(procs, parts):
    """8 microbatches, at most 2 in flight: they start in order and each stage runs the oldest
    first (a later microbatch taking the last slot before an earlier one hung here)."""
    results = run_world(procs, "smp_pipeline.py", ["skip", "manual", "interleaved", str(parts), "8", "3", "2"],
                        env={"SMP_TEST_COUNT_THREADS": "1"}, timeout=120)
    assert_all_ok(results)
    for r in (r.event("trained") for r in results):
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["kept_after_steps"] == [], r["kept_after_steps"]
        # Forwards run on few threads, the same each step (each thread that runs a matrix
        # product on a GPU keeps a cuBLAS workspace): the root's at most `active_microbatches`
        # at a time, served calls on one runner per kind (plus the tracing thread).
        assert r["forward_threads"] <= 4, r


@pytest.mark.parametrize("procs, parts", LAYOUTS, ids=["pp2", "pp3", "pp2xdp2"])
@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_tied_weights_across_partitions_train_like_one_process(procs, parts, pipeline):
    """An embedding on the first partition whose weight is also the last partition's output
    projection: each holds a copy, and the copies get the sum of both uses' gradients (then
    the average over replicas), so the model trains as the one-process model does."""
    results = run_world(procs, "smp_pipeline.py", ["tied", "manual", pipeline, str(parts), "4", "5"], timeout=120)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    for r in reports:
        assert r["keys_match"], r
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"
        assert r["kept_after_steps"] == [], r["kept_after_steps"]
        holds_tie = "embed.weight" in r["local"]
        assert holds_tie == (r["pp_rank"] in (0, parts - 1)), r


@pytest.mark.parametrize("procs, parts, name", [(3, 3, "lamb"), (4, 2, "lamb"), (3, 3, "novograd")],
                         ids=["lamb-pp3", "lamb-pp2xdp2", "novograd-pp3"])
def test_smp_optimizers_train_like_one_process(procs, parts, name):
    """smp.optimizers.FusedLamb with a clip every step reaches: tied weights across the first
    and last partitions (their summed gradient counted once) and replicas (counted once).
    FusedNovoGrad's per-tensor norms need no collective; a tied weight's holders step alike."""
    results = run_world(procs, "smp_pipeline.py", ["tied", "manual", "interleaved", str(parts), "4", "4"],
                        env={"SMP_TEST_OPTIMIZER": name}, timeout=120)
    assert_all_ok(results)
    for r in (r.event("trained") for r in results):
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r


@pytest.mark.parametrize("procs, parts", LAYOUTS, ids=["pp2", "pp3", "pp2xdp2"])
def test_a_gpt_shaped_transformer_auto_partitioned_trains_like_one_process(procs, parts):
    """A small GPT-2-shaped decoder (causal attention blocks called from a Python loop over a
    ModuleList, layer norms, the output projection tied to the token embedding), split by
    the automatic partitioner: the same parameters and losses as one process."""
    results = run_world(procs, "smp_pipeline.py", ["gpt", "auto", "interleaved", str(parts), "4", "5"], timeout=120)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    owned = [set(r["local"]) for r in reports if r["dp_rank"] == 0]
    assert sum(1 for o in owned if o) == parts, f"the model was not split into {parts}: {owned}"
    blocks = [sum(1 for n in o if n.startswith("blocks.") and n.endswith(".ln1.weight")) for o in owned]
    assert max(blocks) < 4, f"the blocks were not spread over the partitions: {blocks}"
    holders = sorted(r["pp_rank"] for r in reports if r["dp_rank"] == 0 and "wte.weight" in r["local"])
    assert holders == [0, parts - 1], f"the tied embedding should cross partitions: {holders}"
    for r in reports:
        assert r["keys_match"], r
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"
        # Nothing of a finished step stays alive (idle pipeline threads kept their last task's
        # microbatch, and with it the tensors of its graph).
        assert r["kept_after_steps"] == [], r["kept_after_steps"]


@pytest.mark.parametrize("procs, parts", [(2, 2), (4, 2)], ids=["pp2", "pp2xdp2"])
def test_hugging_face_gpt2_auto_partitioned_trains_like_one_process(procs, parts):
    """transformers' GPT2LMHeadModel (small random configuration; its lm_head tied to the
    token embedding) under smp with the automatic partitioner: the same parameters and
    losses as one process (SGD with momentum). transformers comes with the [integrations] extra."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    results = run_world(procs, "smp_hf_gpt2.py", [str(parts), "interleaved", "4"], timeout=180)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    holders = sorted(r["pp_rank"] for r in reports if r["dp_rank"] == 0 and "transformer.wte.weight" in r["local"])
    assert holders == [0, parts - 1], holders
    for r in reports:
        assert r["keys_match"], r
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"


def test_a_rank_that_holds_no_parameters_still_steps():
    """Manual partitioning without smp.partition contexts puts everything on partition 0: the
    other rank owns nothing, serves nothing, and its optimizer steps nothing."""
    results = run_world(2, "smp_pipeline.py", ["seq", "manual", "simple", "2", "2", "3"], timeout=120)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    assert reports[1]["local"] == [] and reports[0]["local"]
    assert all(r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5 for r in reports), reports


@pytest.mark.parametrize("case, procs", [("modules", 4), ("bn", 2), ("padding", 4)])
def test_module_semantics_survive_partitioning(case, procs):
    """modules: a hook that changes inputs, outputs or gradients, and pruning's mask, apply once
    (on the module's owner), not once on each rank the call passes; an nn.Sequential subclass
    runs its own forward; frozen parameters, one tied across the partitions, stay as they were
    under AdamW's weight decay (as torch DDP leaves them); a named tuple from the step function
    holds StepOutputs. bn: the automatic partition's trace leaves BatchNorm's running
    statistics as they were. padding: replicas whose first batches differ in length (dynamic
    padding) take rank 0's partition instead of failing on their own choice."""
    results = run_world(procs, "smp_semantics.py", [case], timeout=120)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    for r in reports:
        assert r["keys_match"], r
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r
        assert r["frozen_unchanged"], r
        assert r["hook_calls"] * (procs // 2) == r["ref_hook_calls"], r
    if case == "modules":
        assert reports[0]["frozen"] == ["embed.weight", "lower.weight", "lower.bias"], reports[0]["frozen"]
        assert reports[0]["hook_calls"] == 3 * 2, reports[0]  # steps x microbatches of one replica
    if case == "padding":  # the replicas' matching ranks hold the same modules
        assert reports[0]["local"] == reports[2]["local"] and reports[1]["local"] == reports[3]["local"], reports


def test_misuse_gets_clear_errors_and_the_pipeline_still_works():
    results = run_world(2, "smp_errors.py", ["misuse"], timeout=90)
    assert_all_ok(results)
    assert all("MISUSE OK" in r.stdout for r in results)


def test_backward_called_on_one_rank_only_is_an_error_on_every_rank():
    results = run_world(2, "smp_errors.py", ["backward_on_one_rank"], timeout=90)
    assert_all_ok(results)
    assert all("BACKWARD ON ONE RANK OK" in r.stdout for r in results)


@pytest.mark.parametrize("env", [{}, {"SMDDP_SMP_INLINE_OUTPUT": "0"}], ids=["step-function-serves", "runner-serves"])
def test_the_model_called_on_one_rank_only_is_an_error_on_every_rank(env):
    results = run_world(2, "smp_errors.py", ["model_on_one_rank"], env=env, timeout=90)
    assert_all_ok(results)
    assert all("MODEL ON ONE RANK OK" in r.stdout for r in results)


@pytest.mark.parametrize("procs, case, done", [
    (2, "forward_after_backward", "FORWARD AFTER BACKWARD OK"),
    (3, "forward_after_backward_new_stage", "FORWARD AFTER BACKWARD NEW STAGE OK"),
], ids=["last-stage", "new-stage"])
def test_a_forward_after_the_backward_takes_no_place_in_a_window(procs, case, done):
    """A model call after model.backward, gradients on: on the last stage of a rank-ordered
    Sequential, and to a stage a custom forward had not reached (smp_errors.py says more)."""
    results = run_world(procs, "smp_errors.py", [case], timeout=90)
    assert_all_ok(results)
    assert all(done in r.stdout for r in results)


def test_backward_called_on_every_rank_but_the_root_is_an_error_on_every_rank():
    results = run_world(3, "smp_errors.py", ["backward_not_on_root"], timeout=90)
    assert_all_ok(results)
    assert all("BACKWARD NOT ON ROOT OK" in r.stdout for r in results)


def test_backward_called_twice_in_a_microbatch_is_an_error_on_every_rank():
    results = run_world(2, "smp_errors.py", ["backward_twice"], timeout=90)
    assert_all_ok(results)
    assert all("BACKWARD TWICE OK" in r.stdout for r in results)


def test_bad_configuration_is_refused_on_every_rank_before_any_work():
    results = run_world(2, "smp_errors.py", ["bad_config"], timeout=90)
    assert_all_ok(results)
    assert all("unknown configuration key 'partitons'" in r.stdout for r in results)


def test_a_rank_that_dies_mid_step_is_named_on_every_other_rank():
    results = run_world(3, "smp_errors.py", ["rank_dies"], timeout=90)
    assert results[1].returncode == 3, results[1].output
    for r in (results[0], results[2]):
        assert r.returncode == 0, r.output
        assert r.event("step_failed")["kind"] == "StepFailed", r.output
        assert "STEP FAILED" in r.stdout and "rank 1" in r.stdout, r.output
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("smddp-")]
    assert not leftovers, leftovers


@pytest.mark.parametrize("value,expected", [("", None), ("7.5", 7.5), ("0", None), ("abc", ValueError),
                                            ("inf", ValueError)])
def test_smp_init_bounds_the_rendezvous_by_smddp_timeout_where_set(monkeypatch, value, expected):
    from smdistributed.modelparallel.torch.state import _startup_timeout

    monkeypatch.setenv("SMDDP_TIMEOUT", value)
    if expected is ValueError:
        with pytest.raises(ValueError, match="SMDDP_TIMEOUT"):
            _startup_timeout()
    elif expected is None:
        assert _startup_timeout() == {}
    else:
        assert _startup_timeout()["timeout"].total_seconds() == expected


def test_ranks_whose_rank_0_died_before_smp_init_fail_within_the_timeout():
    timeout = 4
    results = run_world(3, "smp_errors.py", ["rank0_dies_before_init"], env={"SMDDP_TIMEOUT": str(timeout)},
                        timeout=90)
    assert results[0].returncode == 3, results[0].output
    for r in results[1:]:
        assert r.returncode == 0, r.output
        e = r.event("init_failed")
        # Not torch's 30 minutes: the timeout, plus smp.init's imports on a slow machine.
        assert e["after_s"] <= timeout + 30, e
        assert "timed out" in e["message"].lower(), e


def test_a_rank_that_dies_mid_step_with_replicas_fails_every_other_rank():
    """pp=2 x dp=2 (cluster placement: replicas [0, 1] and [2, 3]), global rank 1 dies."""
    timeout = 5
    results = run_world(4, "smp_errors.py", ["rank_dies_with_replicas"], env={"SMDDP_TIMEOUT": str(timeout)},
                        timeout=90)
    assert results[1].returncode == 3, results[1].output
    for r in (results[0], results[2], results[3]):
        assert r.returncode == 0, r.output
        e = r.event("step_failed")
        assert e["kind"] == "StepFailed" and e["after_s"] <= timeout + 3, e
    # The dead rank's pipeline peer names it; its data-parallel peer names it by its place in
    # their group, and the message says which global rank that is.
    assert "global rank 1" in results[0].event("step_failed")["message"]
    m = results[3].event("step_failed")["message"]
    assert "global ranks [1, 3]" in m and "rank 0 = global rank 1" in m and "rank 0 (pid" in m, m
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("smddp-")]
    assert not leftovers, leftovers


def test_replicas_out_of_step_fail_instead_of_averaging_different_steps():
    """A step refused on one replica only (its batch), the error caught: at the next gradient
    reduction the replicas are one smp.step call apart, and every rank says so."""
    results = run_world(4, "smp_errors.py", ["replica_skips_a_step"], env={"SMDDP_TIMEOUT": "10"}, timeout=90)
    assert_all_ok(results)
    for r in results:
        e = r.event("step_failed")
        assert "different smp.step calls" in e["message"], e
        assert e["step"] == (2 if r.rank in (0, 1) else 3), e  # replicas [0, 1] and [2, 3]
    assert [r.event("skipped")["step"] for r in results[2:]] == [2, 2]


def test_a_rank_that_stops_mid_step_is_named_on_every_other_rank():
    """A stage stopped mid-step (SIGSTOP: alive, sockets open, silent) is not a quiet link:
    its engine no longer answers pings, so the other stages' steps fail within the timeout
    plus a little, naming it."""
    timeout = 4
    results = run_world(3, "smp_errors.py", ["rank_stops"], env={"SMDDP_TIMEOUT": str(timeout)},
                        kill_after_others=[1], timeout=90)
    for r in (results[0], results[2]):
        assert r.returncode == 0, r.output
        e = r.event("step_failed")
        assert "rank 1 has not answered" in e["message"], e["message"]
        assert e["after_s"] <= timeout + 3, e


# -- the seed scripts, under each launcher -----------------------------------------------------------
def _launch(launcher, procs, script, params, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", SMDDP_TIMEOUT="60", SM_HP_MP_PARAMETERS=json.dumps(params),
               PYTHONPATH=str(EXAMPLES))
    if launcher == "smddprun":
        cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", str(procs), "--", sys.executable,
               str(EXAMPLES / script)]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
               str(free_port()), str(EXAMPLES / script)]
    else:
        if shutil.which("mpirun") is None:
            pytest.skip("mpirun is not installed (Debian: openmpi-bin)")
        cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(procs), "-x", "SM_HP_MP_PARAMETERS",
               "-x", "PYTHONPATH", "-x", "CUDA_VISIBLE_DEVICES", sys.executable, str(EXAMPLES / script)]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("launcher, procs, script, params", [
    ("smddprun", 2, "seed002_auto_partition.py", {"partitions": 2, "microbatches": 4}),
    ("torchrun", 2, "seed002_manual_partition.py",
     {"partitions": 2, "microbatches": 2, "pipeline": "simple", "auto_partition": False, "default_partition": 0}),
    ("smddprun", 4, "seed002_manual_partition.py",
     {"partitions": 2, "microbatches": 4, "ddp": True, "auto_partition": False, "default_partition": 0}),
    ("mpirun", 2, "seed002_auto_partition.py", {"partitions": 2, "microbatches": 4}),
], ids=["auto-smddprun", "manual-torchrun", "manual-ddp-smddprun", "auto-mpirun"])
def test_seed_002_scripts_run_under_each_launcher(launcher, procs, script, params, tmp_path):
    proc = _launch(launcher, procs, script, params, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Ranks share the launcher's stdout, so lines can run together: match the records.
    found = re.findall(r"rank (\d+) batch (\d+) loss (\S+?)(?=rank|\s|$)", proc.stdout)
    assert len(found) == 2 * procs, proc.stdout
    by_rank = {}
    for rank, batch, loss in found:
        assert float(loss) < 10, proc.stdout  # finite (nan compares false)
        by_rank.setdefault(int(rank), {})[int(batch)] = float(loss)
    # Every pipeline rank of a replica reports the same loss (each gets the StepOutputs).
    for first in range(0, procs, 2):
        assert by_rank[first] == by_rank[first + 1], by_rank


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_ranks_groups_object_helpers_and_model_api(placement):
    results = run_world(4, "smp_api.py", [placement], timeout=120)
    assert_all_ok(results)
    assert all("API OK" in r.stdout for r in results)
    assert "partition 0:" in results[0].stdout  # rank 0 logs the partition it chose


@pytest.mark.parametrize("parts, procs, tied", [(2, 2, False), (3, 3, False), (2, 4, False), (3, 3, True)],
                         ids=["pp2", "pp3", "pp2xdp2", "pp3-tied"])
def test_partial_and_full_checkpoints_resume_the_same_training(parts, procs, tied, tmp_path):
    runs = {}
    layout = [str(parts), str(procs)]
    env = {"SMP_TEST_TIED": "1"} if tied else {}
    for phase in ("first", "resume_partial", "resume_full", "ckpt_partial", "ckpt_full"):
        results = run_world(procs, "smp_checkpoint.py", [str(tmp_path), phase, *layout], env=env, timeout=120)
        assert_all_ok(results)
        runs[phase] = results[0].event("trained")["losses"]
        if tied:  # the tie crosses partitions: the first and the last hold a copy
            holders = [r.rank for r in results if "embed.weight" in r.event("trained")["local"]]
            assert holders == [0, parts - 1], holders
        if phase == "first":
            names = sorted(os.listdir(tmp_path))
            assert [f"checkpoint.pt_{r}" for r in range(parts)] == [n for n in names if n.startswith("checkpoint")]
            assert "full.pt" in names and not any(".tmp" in n for n in names)
    assert all(runs[p] == runs["first"] for p in runs), runs
    ckpt = sorted(os.listdir(tmp_path / "ckpt"))
    assert ckpt == ["full2", "newest", "optimizer_full2", "step2_partial", "step3_partial", "user_content_full2"], ckpt
    assert (tmp_path / "ckpt" / "newest").read_text() == "step2"
    final = torch.load(tmp_path / f"final_first_{parts}x{procs}.pt")
    for phase in ("resume_partial", "resume_full", "ckpt_partial", "ckpt_full"):
        other = torch.load(tmp_path / f"final_{phase}_{parts}x{procs}.pt")
        assert all(torch.equal(final[k], other[k]) for k in final), phase
    if tied:  # one tensor under both names, as the plain module saves it
        saved = torch.load(tmp_path / "full.pt", weights_only=False)["model_state_dict"]
        assert torch.equal(saved["embed.weight"], saved["head.weight"])
        return
    # The full checkpoint loads into the plain module, keys and all.
    plain = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    plain.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=False)["model_state_dict"])


def test_a_full_checkpoint_from_two_partitions_resumes_on_one_and_three(tmp_path):
    """A full state saved by pp=2 (model and Adam) continues the same training on pp=1 and pp=3."""
    first = run_world(2, "smp_checkpoint.py", [str(tmp_path), "first", "2"], timeout=120)
    assert_all_ok(first)
    want = first[0].event("trained")["losses"]
    final = torch.load(tmp_path / "final_first_2x2.pt")
    for parts in (1, 3):
        results = run_world(parts, "smp_checkpoint.py", [str(tmp_path), "resume_full", str(parts)], timeout=120)
        assert_all_ok(results)
        got = results[0].event("trained")["losses"]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (parts, got, want)
        other = torch.load(tmp_path / f"final_resume_full_{parts}x{parts}.pt")
        assert all(torch.allclose(final[k], other[k], rtol=1e-6, atol=1e-7) for k in final), parts


def test_a_partial_checkpoint_of_another_partition_count_is_refused(tmp_path):
    assert_all_ok(run_world(2, "smp_checkpoint.py", [str(tmp_path), "first", "2"], timeout=120))
    results = run_world(3, "smp_checkpoint.py", [str(tmp_path), "ckpt_wrong_parts", "3"], timeout=120)
    assert_all_ok(results)
    for r in results:
        assert "holds a checkpoint of 2 partitions, but this run has 3" in r.stdout, r.output
    results = run_world(3, "smp_checkpoint.py", [str(tmp_path), "load_wrong_parts", "3"], timeout=120)
    assert_all_ok(results)
    for r in results[:2]:
        assert "saved from 2 partitions, but this run has 3" in r.stdout, r.output
    assert "checkpoint.pt_2 does not exist" in results[2].stdout, results[2].output


def test_a_missing_partial_file_is_named(tmp_path):
    results = run_world(2, "smp_checkpoint.py", [str(tmp_path), "resume_partial", "2"], timeout=60)
    for r in results:
        assert r.returncode != 0 and "checkpoint.pt_" in r.stderr and "does not exist" in r.stderr, r.output


@pytest.mark.parametrize("model", ["skip", "seq"])
def test_activation_checkpointing_trains_like_one_process(model):
    results = run_world(2, "smp_pipeline.py", [model, "manual" if model == "skip" else "auto", "interleaved", "2",
                                               "4", "3"], env={"SMP_TEST_CHECKPOINTING": "1"}, timeout=120)
    assert_all_ok(results)
    for r in results:
        report = r.event("trained")
        assert report["param_rel_err"] < 1e-5 and report["loss_rel_err"] < 1e-5, report


@pytest.mark.parametrize("where", ["1", "inside"], ids=["around-the-step", "inside-the-step-function"])
def test_bf16_autocast_reaches_every_stage(where):
    """Autocast state crosses into the step's threads and into calls served for peers, whether
    smp.step is called under it or the step function enters it (each call carries its caller's):
    the output is bf16 on every rank, and training follows one process under the same autocast
    (to bf16 rounding: each microbatch's gradients are rounded separately)."""
    results = run_world(2, "smp_pipeline.py", ["skip", "manual", "simple", "2", "2", "3"],
                        env={"SMP_TEST_AUTOCAST": where}, timeout=120)
    assert_all_ok(results)
    for r in results:
        report = r.event("trained")
        assert report["param_rel_err"] < 5e-3 and report["loss_rel_err"] < 5e-3, report  # measured 4e-4


@pytest.mark.parametrize("procs", [2, 4], ids=["pp2", "pp2xdp2"])
def test_grad_scaler_skips_the_same_steps_on_every_rank(procs):
    results = run_world(procs, "smp_amp.py", timeout=120)
    assert_all_ok(results)
    assert all("AMP OK" in r.stdout for r in results)


def test_checkpointed_module_recomputes_in_backward_and_saves_less():
    from smdistributed.modelparallel.torch.activation_checkpointing import (checkpoint_sequential, checkpointed,
                                                                            set_activation_checkpointing)

    torch.manual_seed(0)
    block = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64, requires_grad=True)

    def run(marked):
        calls = []
        hook = block[0].register_forward_hook(lambda *a: calls.append(1))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            if marked:
                set_activation_checkpointing(block, strategy="contiguous")
            out = checkpointed(block, block.forward, (x,), {})
        object.__setattr__(block, "_smp_checkpoint", None)
        out.sum().backward()
        hook.remove()
        grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
        block.zero_grad()
        x.grad = None
        return grads, len(calls), sum(saved)

    plain, plain_calls, plain_saved = run(False)
    ckpt, ckpt_calls, ckpt_saved = run(True)
    assert plain_calls == 1 and ckpt_calls == 2  # the forward ran again in backward
    assert ckpt_saved < plain_saved / 4, (ckpt_saved, plain_saved)
    assert all(torch.allclose(a, b) for a, b in zip(plain, ckpt))
    out = checkpoint_sequential(block, x, strategy="group_2")
    assert torch.allclose(out, block(x))


def test_links_quiet_for_longer_than_the_timeout_are_not_failures():
    results = run_world(3, "smp_errors.py", ["quiet_links"], env={"SMDDP_TIMEOUT": "2", "SMP_TEST_SLOW_S": "4"},
                        timeout=120)
    assert_all_ok(results)
    assert all("QUIET OK" in r.stdout for r in results)


def test_a_step_standing_still_is_reported_by_the_rank_that_waits():
    """The middle stage computes for 4 s while the root waits for its answer with nothing
    arriving: with SMDDP_STALL_WARNING=1 the root logs what it waits for (it would say the
    same of a rank stuck for good); the computing stage logs nothing, and the step completes."""
    results = run_world(3, "smp_errors.py", ["slow_middle_stage"],
                        env={"SMDDP_TIMEOUT": "2", "SMP_TEST_SLOW_S": "4", "SMDDP_STALL_WARNING": "1"}, timeout=120)
    assert_all_ok(results)
    assert all("QUIET OK" in r.stdout for r in results)
    reports = [line for line in results[0].stderr.splitlines()
               if "nothing arrived from the other pipeline ranks" in line]
    assert reports, results[0].output
    assert "smp: pipeline rank 0 (global rank 0), step 1:" in reports[0] and "on partition 1" in reports[0], reports
    assert "nothing computes here" in reports[0], reports
    assert "nothing arrived" not in results[1].stderr, results[1].stderr  # it computes: not stalled


def test_a_message_that_stops_halfway_is_a_fault_not_a_quiet_link():
    results = run_world(2, "smp_errors.py", ["message_stops_halfway"], env={"SMDDP_TIMEOUT": "2"}, timeout=90)
    assert_all_ok(results)
    assert all("HALFWAY OK" in r.stdout for r in results)


def test_join_trains_replicas_with_uneven_inputs():
    results = run_world(4, "smp_join.py", timeout=120)
    assert_all_ok(results)
    assert all("JOIN OK" in r.stdout for r in results)


@pytest.mark.parametrize("mode", ["bpps2", "hook"])
def test_ddp_options_train_like_one_process(mode):
    """backward_passes_per_step, register_comm_hook and overlapping_allreduce on pp=2 x dp=2.
    With overlap on, the last stage's reduction starts before its step ends (its backward is
    done while the first stage still runs the last microbatch's)."""
    results = run_world(4, "smp_ddp.py", [mode], timeout=120)
    assert_all_ok(results)
    lines = [re.search(r"DDP OK .*", r.stdout).group(0) for r in results]
    if mode == "hook":
        assert all("overlapped=True" in line for line in lines if "pp_rank=1" in line), lines
    else:
        assert all("overlapped=False" in line for line in lines), lines

