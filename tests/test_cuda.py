"""The CUDA path of the smddp backend: NCCL through the core, with CUDA tensors.

These need two GPUs and a CUDA build of torch, and skip cleanly anywhere else (CI has no
GPU). They run the same workers as the CPU tests with SMDDP_TEST_DEVICE=cuda, so every
check the CPU path passes is checked on the GPU too, and compare with torch's NCCL backend.

With 4 GPUs the worlds have 4 ranks and the pipeline tests add the pp=2 x dp=2 and pp=4
layouts; the file then takes more than 10 minutes (4 x H200: about 250 s for
`-k modelparallel`, more than 400 s for the rest), so run the two halves separately where a
command's time is limited.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from world import assert_all_ok, run_world  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
needs_a_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_four_gpus = pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA GPUs")
# A pipeline of 2 stages runs on one GPU too: both ranks share it and their link carries CUDA
# tensors through host memory (NCCL refuses two ranks on one device); on 2 GPUs, through NCCL.
SHARED_GPU = GPUS == 1  # (a 2-stage pipeline's ranks share it)
WORLD = min(max(GPUS, 2), 4)  # one rank per GPU, up to 4


def _raised(result):
    """The "RAISED: <message>" lines a worker of torch_cuda_errors.py printed."""
    return [line for line in result.stdout.splitlines() if line.startswith("RAISED:")]


def test_no_nccl_is_a_clear_error_not_a_crash():
    """Without NCCL the core says so, and why, instead of failing at import or crashing."""
    env = dict(os.environ, SMDDP_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    code = "from smdistributed import _core; print('REASON', _core.gpu_unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SMDDP_NCCL_LIBRARY=/nonexistent/libnccl.so.2" in out.stdout or "libcudart" in out.stdout, out.stdout


@needs_two_gpus
def test_cuda_tensor_without_nccl_raises():
    env = {"SMDDP_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}
    results = run_world(1, "torch_cuda_no_nccl.py", env=env, gpus=True, timeout=120)
    assert_all_ok(results)
    assert "NO NCCL OK" in results[0].stdout, results[0].output


@needs_two_gpus
def test_cuda_every_collective_and_dtype():
    """The CPU suite's torch_collectives worker, on GPUs: every collective x dtype x async mode,
    non-contiguous tensors, inputs dropped while in flight, bad input."""
    results = run_world(WORLD, "torch_collectives.py", gpus=True, timeout=600)
    assert_all_ok(results)
    for r in results:
        checked = r.events("checked")
        assert len(checked) == 9 and all(c["ok"] and c["device"] == "cuda" for c in checked), r.output


@needs_two_gpus
def test_cuda_results_equal_torch_nccl():
    results = run_world(WORLD, "torch_cuda_vs_nccl.py", gpus=True, timeout=600)
    assert_all_ok(results)
    assert all("CUDA VS NCCL OK" in r.stdout for r in results)


@needs_two_gpus
def test_cuda_ddp_matches_single_process():
    from test_torch_ddp import DDP_VARIANTS

    results = run_world(WORLD, "torch_ddp.py", DDP_VARIANTS, gpus=True, timeout=600)
    assert_all_ok(results)
    for r in results:
        assert "DDP OK" in r.stdout, r.output


@needs_two_gpus
def test_cuda_fsdp_matches_single_process():
    results = run_world(WORLD, "torch_fsdp.py", gpus=True, timeout=600)
    assert_all_ok(results)
    assert all("FSDP OK" in r.stdout for r in results)


@needs_two_gpus
@pytest.mark.parametrize("case", ["api", "ddp", "ddp-nosync", "ddp-unused", "ddp-buffers"])
def test_cuda_legacy_api_and_ddp(case):
    results = run_world(WORLD, "torch_legacy.py", [case], gpus=True, timeout=600)
    assert_all_ok(results)


@needs_two_gpus
@pytest.mark.parametrize("case, expected", [
    ("shape", ["disagree on the shape", "rank 0 has [4]", "rank 1 has [5]"]),
    ("dtype", ["disagree on the dtype", "rank 0 has float32", "rank 1 has float64"]),
    ("root", ["disagree on the root"]),
])
def test_cuda_disagreeing_ranks_raise_on_every_rank(case, expected):
    """The arguments of every CUDA collective are negotiated beside NCCL: a mismatch aborts the
    communicator on every rank with the engine's message instead of hanging in NCCL."""
    results = run_world(2, "torch_cuda_errors.py", [case], env={"SMDDP_TIMEOUT": "20"}, gpus=True, timeout=120)
    assert_all_ok(results)
    for r in results:
        raised = _raised(r)
        assert raised, r.output
        for fragment in expected:
            assert fragment in raised[0], r.output


ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}  # every rank on the first GPU, whatever the machine has


@needs_a_gpu
@pytest.mark.parametrize("backend", ["native", "python"])
def test_cuda_collectives_of_ranks_on_one_gpu_go_through_host(backend):
    """NCCL runs nothing between two ranks of one GPU, so the group's collectives on CUDA
    tensors go through host memory: the CPU suite's worker, 3 ranks on one GPU, every collective
    x dtype x async mode, every element checked, under both forms of the backend."""
    env = dict(ONE_GPU, SMDDP_TORCH_BACKEND=backend)
    results = run_world(3, "torch_collectives.py", gpus=True, env=env, timeout=600)
    assert_all_ok(results)
    for r in results:
        checked = r.events("checked")
        assert len(checked) == 9 and all(c["ok"] and c["device"] == "cuda" for c in checked), r.output
    assert "share one GPU" in results[0].stderr, results[0].stderr[-2000:]  # rank 0 warns once


@needs_a_gpu
def test_cuda_ddp_of_ranks_on_one_gpu_matches_single_process():
    """torch DDP over smddp, 3 ranks on one GPU (gradient hooks and futures through host
    memory): the same parameters as one process, in every DDP variant."""
    from test_torch_ddp import DDP_VARIANTS

    results = run_world(3, "torch_ddp.py", DDP_VARIANTS, gpus=True, env=ONE_GPU, timeout=600)
    assert_all_ok(results)
    for r in results:
        assert "DDP OK" in r.stdout, r.output


@needs_a_gpu
@pytest.mark.parametrize("backend", ["native", "python"])
def test_cpu_collectives_while_the_default_device_is_cuda(backend):
    """torch.set_default_device("cuda") in a script: CPU gathers and all_to_all still stage in
    host memory (the engine was handed GPU pointers before, and the ranks crashed)."""
    env = {"SMDDP_TORCH_BACKEND": backend}
    results = run_world(2, "torch_default_device.py", ["cuda"], gpus=True, env=env, timeout=120)
    assert_all_ok(results)
    assert all("DEFAULT DEVICE OK" in r.stdout for r in results)


@needs_a_gpu
def test_cuda_older_ddp_on_one_gpu_gets_a_clear_error():
    """The older API's DistributedDataParallel makes its own NCCL communicator, which NCCL refuses
    for two ranks of one device ('invalid usage'); smddp says so first, on every rank."""
    results = run_world(2, "torch_cuda_errors.py", ["shared-gpu"], env=ONE_GPU, gpus=True, timeout=120)
    assert_all_ok(results)
    for r in results:
        raised = _raised(r)
        assert raised and "ranks 0, 1 of this group are on one GPU" in raised[0], r.output


@needs_two_gpus
@pytest.mark.parametrize("backlog", ["1024", "0"])
def test_cuda_rank_far_ahead_queues_its_checks_not_its_collectives(backlog):
    """A rank 120 calls ahead of its peer (more than the 16 check names of a kind) queues its
    argument checks and goes on issuing NCCL work, as NCCL alone would let it; every result is
    exact. With SMDDP_CUDA_CHECK_BACKLOG=0 it waits instead, as before the queue existed."""
    results = run_world(2, "torch_cuda_errors.py", ["ahead"], env={"SMDDP_CUDA_CHECK_BACKLOG": backlog},
                        gpus=True, timeout=120)
    assert_all_ok(results)
    line = next(x for x in results[0].stdout.splitlines() if x.startswith("AHEAD OK"))
    counts = dict(kv.split("=") for kv in line.split()[2:])
    if backlog == "0":
        assert int(counts["waits"]) > 0 and int(counts["deferred"]) > 0, line
    else:
        assert int(counts["deferred"]) > 0 and int(counts["waits"]) == 0, line


@needs_two_gpus
def test_cuda_mismatch_behind_queued_checks_raises_on_every_rank():
    """A shape mismatch whose check was queued (its rank far ahead) still raises on both ranks."""
    results = run_world(2, "torch_cuda_errors.py", ["ahead-shape"], env={"SMDDP_TIMEOUT": "20"}, gpus=True,
                        timeout=120)
    assert_all_ok(results)
    for r in results:
        raised = _raised(r)
        assert raised and "disagree on the shape" in raised[0], r.output


@needs_two_gpus
def test_cuda_dead_peer_raises():
    """A rank that dies makes the survivor's CUDA collectives raise, naming the dead rank."""
    results = run_world(2, "torch_cuda_errors.py", ["dead"], env={"SMDDP_TIMEOUT": "10"}, gpus=True, timeout=120)
    assert results[1].returncode == 3
    assert results[0].returncode == 0, results[0].output
    assert "rank 1" in results[0].stdout, results[0].output


@needs_two_gpus
@pytest.mark.parametrize("case", ["dead", "stalled"])
def test_cuda_torch_ddp_raises_when_a_peer_dies_or_stalls(case):
    """torch DDP on GPUs through smddp (NCCL): a peer that dies or stops mid-training makes
    every survivor raise, naming it, within the timeout plus a little (the CPU suite's
    test_torch_ddp_raises_when_a_peer_dies_or_stalls, on GPUs)."""
    timeout = 10
    n = min(GPUS, 3)
    results = run_world(n, "torch_ddp_faults.py", [case], env={"SMDDP_TIMEOUT": str(timeout)}, gpus=True,
                        kill_after_others=[n - 1] if case == "stalled" else [], timeout=120)
    for r in results[:-1]:
        assert r.returncode == 0, r.output
        e = r.event("raised")
        assert f"rank {n - 1}" in e["message"] or f"rank(s) {n - 1}" in e["message"], e["message"]
        assert e["after_s"] <= timeout + 3, e


LEGACY_VS_NCCL = {
    # model: variants run in one world (each a fresh pair of models)
    "resnet": "default,overlap,after,small-buckets,bf16,nosync,unused,no-buffers,torch-ddp-smddp",
    "transformer": "default,overlap,bf16,torch-ddp-smddp",
    "mlp": "default,nosync,unused",
}


@needs_two_gpus
@pytest.mark.parametrize("model", list(LEGACY_VS_NCCL))
def test_cuda_legacy_ddp_gradients_equal_torch_ddp_nccl(model):
    """The older DistributedDataParallel's gradients, parameters and buffers equal torch DDP's
    over NCCL after every one of 5 steps, for every option, on models whose first layers'
    gradients come last in backward (a reduction racing backward reads them unfinished)."""
    results = run_world(WORLD, "torch_legacy_vs_nccl.py", [model, LEGACY_VS_NCCL[model]], gpus=True, timeout=600)
    assert_all_ok(results)
    for r in results:
        assert r.stdout.count("LEGACY VS NCCL OK") == len(LEGACY_VS_NCCL[model].split(",")), r.output


@needs_two_gpus
def test_cuda_horovod_api_and_training():
    """Horovod's PyTorch API on CUDA tensors (NCCL), DistributedOptimizer training against one
    process, SyncBatchNorm statistics over every rank's batch."""
    results = run_world(WORLD, "torch_horovod.py", gpus=True, timeout=600)
    assert_all_ok(results)
    assert all("HOROVOD API OK" in r.stdout for r in results)


@needs_two_gpus
def test_cuda_per_device_backend_api():
    """device_id=, _get_backend('cuda'), new_group, DeviceMesh with DTensor, split_group and
    destroy_process_group on GPUs."""
    results = run_world(WORLD, "torch_backend_api.py", gpus=True, timeout=300)
    assert_all_ok(results)
    assert all("BACKEND API OK" in r.stdout for r in results)


def _launch(worker, env=None, timeout=600):
    """The worker under smddprun, one rank per GPU, as users start it."""
    from pathlib import Path

    path = Path(__file__).parent / "workers" / worker
    cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", str(WORLD), "--", sys.executable, str(path)]
    e = dict(os.environ, SMDDP_TEST_DEVICE="cuda", SMDDP_TIMEOUT="120", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e,
                          cwd=str(path.parent))


@needs_two_gpus
def test_cuda_lightning_ddp_strategy_on_smddp():
    """Lightning's DDPStrategy(process_group_backend="smddp") on GPUs: Lightning passes device_id
    and asks the group for its CUDA Backend; training equals one process."""
    pytest.importorskip("pytorch_lightning")
    proc = _launch("lightning_ddp.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("LIGHTNING OK") == WORLD, proc.stdout + proc.stderr


@needs_two_gpus
def test_cuda_hugging_face_trainer_with_sagemaker_switch(tmp_path):
    """transformers' Trainer with SM_FRAMEWORK_PARAMS' data-parallel switch: it (and accelerate)
    import torch_smddp and init smddp themselves, reading SMDATAPARALLEL_LOCAL_RANK."""
    pytest.importorskip("transformers")
    proc = _launch("hf_trainer_smddp.py", env={"HF_OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("HF TRAINER OK") == WORLD, proc.stdout + proc.stderr


# (processes, partitions): pp=2 on 2 GPUs; on 4 GPUs, pp=2 x dp=2 and pp=4 (the 4-GPU layouts
# skip on a 2-GPU machine).
# Every layout runs on any number of GPUs: ranks on one GPU (rank % GPUs) link through host
# memory, and their groups' collectives (the replicas' gradients, tied weights) go through it too.
GPU_LAYOUTS = [pytest.param(2, 2, id="pp2"),
               pytest.param(4, 2, id="pp2xdp2"),
               pytest.param(4, 4, id="pp4")]


def _link_kinds(rank: int, procs: int, parts: int):
    """(links of `rank` through host memory, pipeline peers over NCCL) when each rank takes GPU
    rank % GPUS and replicas are consecutive ranks ("cluster")."""
    first = rank - rank % parts
    peers = [q for q in range(first, first + parts) if q != rank]
    shared = sum(1 for q in peers if q % GPUS == rank % GPUS)
    return 2 * shared, len(peers) - shared  # both directions of each shared pair


@needs_a_gpu
@pytest.mark.parametrize("procs, parts", GPU_LAYOUTS)
@pytest.mark.parametrize("model, mode, pipeline", [("skip", "manual", "interleaved"), ("seq", "auto", "simple"),
                                                   ("skip", "auto", "simple"), ("seqparts", "manual", "interleaved"),
                                                   ("seqfrozen", "manual", "interleaved")])
def test_cuda_modelparallel_pipeline_trains_like_one_gpu(procs, parts, model, mode, pipeline):
    """Activations and gradients cross through NCCL (through host memory between ranks on one
    GPU); with dp=2 the replicas' gradients too.
    The model is moved to the GPU before it is wrapped: the other stages' parameters leave it.
    "seqfrozen" (the first stage frozen): the last stage's merged answer carries the output's
    copy, received on CUDA, and no gradient."""
    results = run_world(procs, "smp_pipeline.py", [model, mode, pipeline, str(parts), "4", "5"], gpus=True,
                        timeout=300, env={"SMP_TEST_MOVED_BEFORE_WRAP": "1"})
    assert_all_ok(results)
    for r in results:
        report = r.event("trained")
        assert report["others_on"] in ([], ["cpu"]), report["others_on"]
        assert report["param_rel_err"] < 1e-5 and report["loss_rel_err"] < 1e-5, report
        assert report["losses"] == results[0].event("trained")["losses"], "ranks disagree on the loss"
        staged, over_nccl = _link_kinds(report["rank"], procs, parts)
        assert report["host_staged_links"] == staged, report
        # The NCCL links this rank used are capped at the default 2 blocks; a pair on one GPU has none.
        assert set(report["link_ctas"].values()) <= {2}, report["link_ctas"]
        assert bool(report["link_ctas"]) or not over_nccl or parts > 2, report["link_ctas"]
    if model == "seq" and mode == "auto" and parts == 4:  # stage to stage: ranks 1 and 2 pass each forward on
        hops = {r.event("trained")["pp_rank"]: r.event("trained")["chained_hops"] for r in results}
        assert hops == {0: 0, 1: 20, 2: 20, 3: 0}, hops


@needs_a_gpu
@pytest.mark.parametrize("procs, parts", GPU_LAYOUTS[:2])
@pytest.mark.parametrize("name", ["lamb", "novograd"])
def test_cuda_modelparallel_smp_optimizers_train_like_one_gpu(procs, parts, name):
    """smp.optimizers.FusedLamb (its clip takes the norm over every stage and replica, a
    collective of GPU tensors) and FusedNovoGrad (per-tensor norms, no collective), with a
    weight tied across the first and last stages: the same parameters and losses as one GPU."""
    results = run_world(procs, "smp_pipeline.py", ["tied", "manual", "interleaved", str(parts), "4", "4"],
                        gpus=True, timeout=300, env={"SMP_TEST_OPTIMIZER": name})
    assert_all_ok(results)
    for r in (r.event("trained") for r in results):
        assert r["param_rel_err"] < 1e-5 and r["loss_rel_err"] < 1e-5, r


@needs_a_gpu
@pytest.mark.parametrize("model, mode, pipeline, defer, parts", [
    ("enc", "auto", "interleaved", False, 2), ("enc", "auto", "simple", False, 2),
    ("seq", "auto", "interleaved", False, 2),
    ("skip", "manual", "simple", False, 2), ("resid", "manual", "interleaved", False, 2),
    ("enc", "auto", "interleaved", True, 2), ("enc", "auto", "simple", True, 2), ("skip", "manual", "simple", True, 2),
    ("resid", "manual", "interleaved", True, 2), ("seqreuse", "manual", "interleaved", False, 2),
    ("seqreuse", "manual", "simple", True, 2),
    ("enc", "auto", "interleaved", False, 4), ("enc", "auto", "interleaved", True, 4),
    ("seq", "auto", "simple", False, 4)])
def test_cuda_modelparallel_stage_graphs_train_like_one_gpu(model, mode, pipeline, defer, parts):
    """SMDDP_SMP_CUDA_GRAPHS=1: each stage's Sequential runs are captured after two eager runs
    and replayed, one instance per microbatch in flight; 6 steps of 4 microbatches (captures,
    then replays, in both schedules) train as one GPU does. The encoder stack puts attention
    and layer norm inside the graphs; "skip" graphs a Sequential that a peer calls remotely;
    "resid" replays a run's backward twice per microbatch (a residual around a remote block);
    "seqreuse" calls one Linear twice in each stage's run (its capture once left the Linear
    holding a detached alias of its weight instead of the parameter: silently untrained).
    `defer`: SMDDP_SMP_DEFER_WEIGHT_GRADS=1, runs whose input needs a gradient replay their
    weight pass after the input gradients' message is made (the encoder's second stage).
    `parts` 4: graphed runs in a chain's hops (stage to stage), deferred weight passes on
    stages 1-3."""
    env = {"SMDDP_SMP_CUDA_GRAPHS": "1", "SMDDP_SMP_P2P_MAX_CTAS": "1", "SMDDP_SMP_DEFER_WEIGHT_GRADS": str(int(defer))}
    results = run_world(parts, "smp_pipeline.py", [model, mode, pipeline, str(parts), "4", "6"], gpus=True,
                        timeout=300, env=env)
    assert_all_ok(results)
    reports = [r.event("trained") for r in results]
    for report in reports:
        assert report["param_rel_err"] < 1e-5 and report["loss_rel_err"] < 1e-5, report
        assert report["losses"] == reports[0]["losses"], "ranks disagree on the loss"
        limit = 4  # "simple": every microbatch in flight; "interleaved": active_microbatches, 2 + 2
        assert report["graphs"]["captures"] <= limit * 2, report["graphs"]  # at most 2 runs a rank here
        # Every instance of a run writes its parameters' gradients into the run's one buffer set.
        layout = report["graph_layout"]
        assert layout["grad_buffer_sets"] == layout["runs"] <= layout["instances"], layout
        assert set(report["link_ctas"].values()) <= {1}, report["link_ctas"]  # where a link uses NCCL
        if parts == 2 and not SHARED_GPU:
            assert set(report["link_ctas"].values()) == {1}, report["link_ctas"]
    splits = [r["graphs"]["split_captures"] for r in reports]
    if not defer:
        assert splits == [0] * parts, splits
    elif model == "enc":  # the first stage's input needs no gradient: nothing to send earlier
        assert splits[0] == 0 and all(n > 0 for n in splits[1:]), splits
    replays = [r["graphs"]["replays"] for r in reports]
    # The skip model's only Sequential is on rank 1, the resid model's on rank 0; the others
    # have one on each rank.
    expected = {"skip": [False, True], "resid": [True, False]}.get(model, [True] * parts)
    assert [n > 0 for n in replays] == expected, [r["graphs"] for r in reports]
    if pipeline == "simple":  # 4 microbatches in flight: several instances share one buffer set
        assert max(r["graph_layout"]["instances"] - r["graph_layout"]["runs"] for r in reports) > 0, reports


@needs_a_gpu
def test_cuda_stage_graphs_backward_twice_and_against_eager():
    """One GPU, smp's StageGraphs driven directly. A second backward of one forward (a skip
    connection's two segments) replays the backward graph again on the activations the
    forward replay left, with its dropout masks and BatchNorm's statistics counted once: two
    backwards (gradients a, then b) must give what one backward of a + b gives, outputs and
    running statistics alike. (A backward that freed the activations as it went and did not
    recompute them fails this: a norm of 496 against 128, one H200, session 34.) A graphed run
    without randomness must give what the eager model gives."""
    import torch.nn as nn
    from smdistributed.modelparallel.torch.stage_graphs import StageGraphs

    def model(dropout):
        torch.manual_seed(0)
        layers = [nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(), nn.LayerNorm(64)]
        layers += [nn.Dropout(0.5)] if dropout else []
        return nn.Sequential(*layers, nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).cuda()

    def drive(net, graphs, x, grads, split):
        """Four calls: two eager warm-ups, the capture, a replay. Returns each call's output and
        parameters' gradients, and the running statistics at the end."""
        outs, param_grads = [], []
        for call in range(4):
            torch.manual_seed(100 + call)
            for p in net.parameters():
                p.grad = None
            leases = []
            if graphs is None:
                out = net(x)
            else:
                out = graphs.run(("run",), list(net), x, leases, lambda: net(x))
            if split:
                out.backward(grads[0], retain_graph=True)
                out.backward(grads[1])
            else:
                out.backward(grads[0] + grads[1])
            if graphs is not None:
                graphs.release(leases)
                graphs.flush_gradients()
            outs.append(out.detach().clone())
            param_grads.append([p.grad.clone() for p in net.parameters()])
        return outs, param_grads, [b.clone() for b in net.buffers()]

    def assert_near(got, want):
        # Relative to the whole tensor (the sums round differently), and absolute for a gradient
        # that is zero but for rounding (the bias of a Linear whose output a BatchNorm centres).
        got, want = got.double(), want.double()  # (num_batches_tracked is an integer)
        diff = (got - want).norm().item()
        assert diff <= 1e-5 * want.norm().item() + 1e-5, (diff, want.norm().item())

    x = torch.randn(16, 32, device="cuda")
    grads = [torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")]
    # Two backwards of one forward against one backward of the summed gradient, dropout on.
    runs = {}
    for split in (False, True):
        graphs = StageGraphs(True)
        graphs.limit = 1
        runs[split] = drive(model(True), graphs, x, grads, split)
        assert graphs.counters["replays"] == 2 and graphs.counters["captures"] == 1, graphs.counters
    (outs_one, grads_one, stats_one), (outs_two, grads_two, stats_two) = runs[False], runs[True]
    for call in (2, 3):  # the graphed calls
        assert torch.equal(outs_one[call], outs_two[call]), f"call {call}: the replays' outputs differ"
        for a, b in zip(grads_one[call], grads_two[call]):
            assert_near(b, a)
    for a, b in zip(stats_one, stats_two):
        assert torch.equal(a, b), "the second backward changed BatchNorm's running statistics"
    # Graphed against eager, no randomness: the same outputs and gradients.
    graphs = StageGraphs(True)
    graphs.limit = 1
    eager, graphed = drive(model(False), None, x, grads, False), drive(model(False), graphs, x, grads, False)
    assert graphs.counters["replays"] == 2, graphs.counters
    for call in (2, 3):
        assert_near(graphed[0][call], eager[0][call])
        for a, b in zip(eager[1][call], graphed[1][call]):
            assert_near(b, a)
    for a, b in zip(eager[2], graphed[2]):
        assert_near(b, a)


@needs_a_gpu
def test_cuda_stage_graphs_deferred_weight_pass():
    """One GPU, StageGraphs driven directly with SMDDP_SMP_DEFER_WEIGHT_GRADS's split: two
    microbatches in flight (two instances), each backward replaying its input pass at once
    and its weight pass later (the second microbatch's backward runs the first's first; the
    release runs the second's). Input gradients, parameters' gradients and outputs equal the
    eager model's at every step. A run whose weight is used twice along the input's path keeps
    one backward graph and is still exact."""
    import torch.nn as nn
    from smdistributed.modelparallel.torch.stage_graphs import StageGraphs

    def encoder():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
                               for _ in range(2)], nn.Linear(64, 64)).cuda()

    def reused():
        torch.manual_seed(0)
        lin = nn.Linear(64, 64)
        return nn.Sequential(lin, nn.GELU(), nn.LayerNorm(64), lin).cuda()

    xs = [torch.randn(4, 8, 64, device="cuda") for _ in range(8)]
    gs = [torch.randn(4, 8, 64, device="cuda") for _ in range(8)]

    def drive(net, graphs):
        steps, deferred = [], []
        for step in range(4):  # two eager calls, two captures, then replays
            for p in net.parameters():
                p.grad = None
            flight = []
            for k in (2 * step, 2 * step + 1):
                x = xs[k].clone().requires_grad_()
                leases = []
                out = net(x) if graphs is None else graphs.run(("run",), list(net), x, leases, lambda x=x: net(x))
                flight.append((k, x, out, leases))
            in_grads = []
            for k, x, out, _ in flight:
                out.backward(gs[k])
                in_grads.append(x.grad.clone())  # queued before any deferred weight pass
                if graphs is not None:
                    deferred.append(graphs.weights_deferred())
            if graphs is not None:
                for _, _, _, leases in flight:
                    graphs.release(leases)
                graphs.flush_gradients()
            steps.append(([o.detach().clone() for _, _, o, _ in flight], in_grads,
                          [p.grad.clone() for p in net.parameters()]))
        return steps, deferred

    def assert_near(got, want, what):
        diff = (got.double() - want.double()).norm().item()
        assert diff <= 1e-5 * want.double().norm().item() + 1e-6, (what, diff, want.norm().item())

    for make, splits in ((encoder, True), (reused, False)):
        graphs = StageGraphs(True, split_weights=True)
        graphs.limit = 2
        graphed, deferred = drive(make(), graphs)
        eager, _ = drive(make(), None)
        assert graphs.counters["captures"] == 2 and graphs.counters["replays"] == 6, graphs.counters
        instances = [i for e in graphs._entries.values() for i in e.instances]
        assert all((i.bwd_w is not None) == splits for i in instances), [i.not_split for i in instances]
        assert any(deferred) == splits, deferred
        assert not graphs.weights_deferred()
        for step in range(4):
            for part, name in enumerate(("output", "input gradient", "parameter gradient")):
                for got, want in zip(graphed[step][part], eager[step][part]):
                    assert_near(got, want, f"{make.__name__}, step {step}: {name}")


@needs_a_gpu
def test_cuda_stage_graphs_follow_what_eager_would_read():
    """One GPU, StageGraphs driven directly against the same model run eagerly, call by call:
    a tensor kept as a module attribute replaced (a cache rebuilt) and a Python scalar
    changed between calls are seen (the run is captured again, with the new values); a run
    that changes its attribute at every call ends eager; a parameter kept in a plain list
    (not registered) keeps the run eager, and its gradient is the eager one; so does a draw
    from the host's random numbers in the forward (LayerDrop)."""
    import torch.nn as nn
    from smdistributed.modelparallel.torch.stage_graphs import MAX_ATTRIBUTE_RESTARTS, StageGraphs

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.table = torch.ones(16)  # a plain attribute, as rotary caches are
            self.alpha = 1.0
            self.listed = [nn.Parameter(torch.ones(16))]

        def forward(self, x):
            return self.lin(x) * self.table * self.alpha * (self.listed[0] if self.use_listed else 1)

    def make(use_listed):
        torch.manual_seed(0)
        net = nn.Sequential(Scaled(), nn.GELU(), nn.Linear(16, 16)).cuda()
        net[0].table, net[0].use_listed = net[0].table.cuda(), use_listed
        net[0].listed = [nn.Parameter(torch.ones(16, device="cuda"))]
        return net

    def call(net, graphs, x, g):
        extra = getattr(net[0], "listed", [])
        for p in list(net.parameters()) + extra:
            p.grad = None
        leases = []
        x = x.clone().requires_grad_()
        out = net(x) if graphs is None else graphs.run(("run",), list(net), x, leases, lambda: net(x))
        out.backward(g)
        if graphs is not None:
            graphs.release(leases)
            graphs.flush_gradients()
        return [out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in list(net.parameters()) + extra
                                                          if p.grad is not None]

    def changes(net, i):
        if i == 5:
            net[0].table = torch.full((16,), 2.0, device="cuda")  # replaced, not written in place
        if i == 9:
            net[0].alpha = 0.5

    xs = [torch.randn(8, 16, device="cuda") for _ in range(14)]
    gs = [torch.randn(8, 16, device="cuda") for _ in range(14)]
    for use_listed in (False, True):
        graphs, graphed, eager = StageGraphs(True), make(use_listed), make(use_listed)
        graphs.limit = 1
        for i in range(14):
            changes(graphed, i)
            changes(eager, i)
            got, want = call(graphed, graphs, xs[i], gs[i]), call(eager, None, xs[i], gs[i])
            assert len(got) == len(want), (use_listed, i)
            for a, b in zip(got, want):
                assert (a - b).norm() <= 1e-5 * b.norm() + 1e-6, (use_listed, i, (a - b).norm().item())
        if use_listed:
            assert graphs.counters["captures"] == 0, graphs.counters
        else:  # captured at calls 2, 7 (after the cache) and 11 (after the scalar)
            assert graphs.counters["captures"] == 3 and graphs.counters["replays"] == 8, graphs.counters
    # LayerDrop as Hugging Face models write it (a draw on the host decides whether a layer
    # runs): stays eager, each call drawing as the eager model does.
    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(16, 16)

        def forward(self, x):
            return x if torch.rand([]) < 0.5 else self.layer(x)

    runs, layerdrop_graphs = [], StageGraphs(True)
    layerdrop_graphs.limit = 1
    for graphs in (layerdrop_graphs, None):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), LayerDrop()).cuda()
        runs.append([call(net, graphs, xs[i], gs[i]) for i in range(8)])
    assert layerdrop_graphs.counters["captures"] == 0, layerdrop_graphs.counters
    for got, want in zip(*runs):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), "LayerDrop differs"
    # An attribute that changes at every call: captured again a few times, then eager for good.
    graphs, net = StageGraphs(True), make(False)
    graphs.limit = 1
    for i in range(40):
        net[0].alpha = 1.0 + i
        call(net, graphs, xs[i % 14], gs[i % 14])
    assert graphs.counters["captures"] <= MAX_ATTRIBUTE_RESTARTS + 1 and graphs.counters["eager"] >= 30, graphs.counters
    # A mode toggled for an evaluation pass with gradients, many times over (each epoch's
    # validation), is no such change: each training phase is captured again and replayed.
    graphs, net = StageGraphs(True), make(False)
    graphs.limit = 1
    cycles = MAX_ATTRIBUTE_RESTARTS + 3
    for cycle in range(cycles):
        for i in range(4):  # two eager calls, the capture, a replay
            call(net, graphs, xs[i], gs[i])
        net.eval()
        call(net, graphs, xs[4], gs[4])
        net.train()
    assert graphs.counters["captures"] == cycles and graphs.counters["replays"] == 2 * cycles, graphs.counters


@needs_a_gpu
def test_cuda_stage_graphs_capture_beside_pending_eager_backwards():
    """One GPU, StageGraphs directly, 3 microbatches in flight as in a "simple" step: the
    capture (third call) comes while the two eager microbatches' backwards are pending, and
    they saved a frozen Linear's weight and a tensor kept as an attribute. The warm run
    before the capture must leave those untouched (a copy back bumped their versions, and
    the pending backwards raised). Also a BatchNorm's statistics, which the warm run does
    change and must restore. Outputs and gradients equal the eager model's."""
    import torch.nn as nn
    from smdistributed.modelparallel.torch.stage_graphs import StageGraphs

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.cache = torch.linspace(0.5, 1.5, 16)

        def forward(self, x):
            return x * self.cache

    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16).requires_grad_(False), Scaled(), nn.BatchNorm1d(16),
                            nn.GELU(), nn.Linear(16, 16)).cuda()
        net[2].cache = net[2].cache.cuda()
        return net

    xs = [torch.randn(8, 16, device="cuda") for _ in range(9)]
    gs = [torch.randn(8, 16, device="cuda") for _ in range(9)]

    def drive(net, graphs):
        results = []
        for step in range(3):
            for p in net.parameters():
                p.grad = None
            flight = []
            for k in range(3 * step, 3 * step + 3):
                x, leases = xs[k].clone().requires_grad_(), []
                out = net(x) if graphs is None else graphs.run(("run",), list(net), x, leases, lambda x=x: net(x))
                flight.append((k, x, out, leases))
            for k, x, out, leases in flight:
                out.backward(gs[k])
                if graphs is not None:
                    graphs.release(leases)
                results += [out.detach().clone(), x.grad.clone()]
            if graphs is not None:
                graphs.flush_gradients()
            results += [p.grad.clone() for p in net.parameters() if p.grad is not None]
            results += [b.clone() for b in net.buffers()]
        return results

    graphs = StageGraphs(True)
    graphs.limit = 3
    graphed, eager = drive(make(), graphs), drive(make(), None)
    assert graphs.counters["captures"] >= 1 and graphs.counters["replays"] >= 4, graphs.counters
    assert len(graphed) == len(eager)
    for a, b in zip(graphed, eager):
        a, b = a.double(), b.double()
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-6, ((a - b).norm().item(), b.norm().item())


@needs_two_gpus
@pytest.mark.parametrize("procs, script, params", [
    pytest.param(2, "seed002_auto_partition.py", {"partitions": 2, "microbatches": 4}, id="auto-pp2"),
    pytest.param(4, "seed002_manual_partition.py", {"partitions": 2, "microbatches": 4, "ddp": True,
                                                    "auto_partition": False, "default_partition": 0},
                 id="manual-pp2xdp2", marks=needs_four_gpus),
    pytest.param(4, "seed002_auto_partition.py", {"partitions": 4, "microbatches": 4}, id="auto-pp4",
                 marks=needs_four_gpus),
])
def test_cuda_modelparallel_seed_002_script(procs, script, params, tmp_path):
    examples = Path(__file__).resolve().parent.parent / "examples" / "modelparallel"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(examples), SM_HP_MP_PARAMETERS=json.dumps(params))
    cmd = [sys.executable, "-m", "smdistributed.common.launcher", "-np", str(procs), "--", sys.executable,
           str(examples / script)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" loss ") == 2 * procs, proc.stdout  # two logged batches on every rank


@needs_a_gpu
def test_cuda_modelparallel_checkpoints_resume_the_same_training(tmp_path):
    """Two pipeline stages (on two GPUs, or sharing one): partial and full checkpoints (model and Adam state,
    saved from GPU partitions) resume the same training bitwise, as on CPU."""
    runs = {}
    for phase in ("first", "resume_partial", "resume_full"):
        results = run_world(2, "smp_checkpoint.py", [str(tmp_path), phase, "2", "2"], gpus=True, timeout=180)
        assert_all_ok(results)
        runs[phase] = results[0].event("trained")["losses"]
    assert runs["resume_partial"] == runs["first"] and runs["resume_full"] == runs["first"], runs
    final = torch.load(tmp_path / "final_first_2x2.pt", map_location="cpu")
    for phase in ("resume_partial", "resume_full"):
        other = torch.load(tmp_path / f"final_{phase}_2x2.pt", map_location="cpu")
        assert all(torch.equal(final[k], other[k]) for k in final), phase


@needs_a_gpu
def test_cuda_modelparallel_one_gpu_amp_autocast_and_checkpoint(tmp_path):
    """partitions 1 on a GPU: GradScaler against torch's, bf16 autocast, a partial round trip."""
    results = run_world(1, "smp_gpu_single.py", [str(tmp_path)], gpus=True, timeout=300)
    assert_all_ok(results)
    assert "GPU SINGLE OK" in results[0].stdout
