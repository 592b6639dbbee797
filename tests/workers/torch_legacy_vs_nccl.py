"""The older DistributedDataParallel on GPUs against torch's DDP over NCCL, step by step.

Two copies of one model start from the same weights on every rank: one wrapped in
smdistributed's DistributedDataParallel (its own NCCL communicator, buckets reduced after
or during backward), one in torch.nn.parallel.DistributedDataParallel on a torch NCCL group.
Each rank feeds both the same batch (its own, different from other ranks'). After every
backward, every parameter's gradient must equal torch DDP's (within the rounding of a
different reduction order: NCCL may sum in another order on another communicator, or
within bfloat16's rounding with `reduce_dtype`); after every optimizer step, every parameter
and buffer must too. Local gradients are computed with deterministic kernels, so any other
difference is the wrapper's.

On more than 2 GPUs, each step starts torch's copy from the wrapper's state (parameters,
buffers, momentum). Two ranks' sum is the same in any order, so 2 ranks stay bitwise equal
over all steps; 3 or more are summed in the order of each side's buckets, which differ in
the last bit, and fp32 training amplifies that to 2.5e-3 of the gradients' scale by the
next step (4 x H200, transformer: 1.7e-7 at step 0, 2.5e-3 at step 1), while the same run
in float64 stays within 6.3e-16 at every step: the gap is rounding, not the reduction.
Each step then still checks one reduction against torch's, from equal states.

The models are chosen so that the first layers' gradients come last and late (a ResNet with
BatchNorm at a batch that keeps the GPU busy, a transformer, an MLP): a reduction that does
not wait for the end of backward reads some of them unfinished.

usage: torch_legacy_vs_nccl.py MODEL VARIANT[,VARIANT...] [STEPS]
  MODEL:   resnet | transformer | mlp | small-mlp
  VARIANT: default | overlap | after | small-buckets | bf16 | nosync | unused | no-buffers
           | torch-ddp-smddp (torch's DDP on the smddp backend in place of the wrapper)
           | control (torch DDP on NCCL in place of the wrapper: two identical runs)
"""
import copy
import os
import sys

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers "smddp")
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as LegacyDDP

MODEL, VARIANTS = sys.argv[1], sys.argv[2].split(",")
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 5


def build_model(seed):
    torch.manual_seed(seed)
    if MODEL == "resnet":
        try:
            import torchvision
            return torchvision.models.resnet50(num_classes=10), (16, 3, 64, 64), 10
        except ImportError:  # a ResNet-shaped convnet with BatchNorm, first layers last in backward
            layers = [torch.nn.Conv2d(3, 64, 7, 2, 3), torch.nn.BatchNorm2d(64), torch.nn.ReLU()]
            for _ in range(8):
                layers += [torch.nn.Conv2d(64, 64, 3, 1, 1), torch.nn.BatchNorm2d(64), torch.nn.ReLU()]
            layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)]
            return torch.nn.Sequential(*layers), (16, 3, 64, 64), 10
    if MODEL == "transformer":
        layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
        body = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        return torch.nn.Sequential(body, torch.nn.Flatten(), torch.nn.Linear(256 * 32, 10)), (8, 32, 256), 10
    if MODEL == "small-mlp":  # for the CPU suite
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                   torch.nn.GELU(), torch.nn.Linear(256, 10)), (32, 64), 10
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048),
                               torch.nn.GELU(), torch.nn.Linear(2048, 10)), (64, 512), 10


class WithUnused(torch.nn.Module):
    """A branch no forward uses on odd steps: its parameters get no gradient then."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.sometimes = torch.nn.Linear(10, 10)
        self.use_branch = True

    def forward(self, x):
        y = self.body(x)
        return self.sometimes(y) if self.use_branch else y


REPORT_ONLY = os.environ.get("SMDDP_TEST_REPORT_ONLY") == "1"  # print every difference, raise none
# Diagnosis: in float64 a different summation order differs by ~1e-16, so a gap that remains
# is not rounding amplified by later steps.
DTYPE = getattr(torch, os.environ.get("SMDDP_TEST_DTYPE", "float32"))
# Every step starts torch's copy from the wrapper's state (what more than 2 GPUs do), on CPUs too.
RESYNC = os.environ.get("SMDDP_TEST_RESYNC") == "1"


def compare(what, ours, theirs, tol):
    """Largest difference of two dicts of tensors relative to each tensor's scale."""
    worst = (0.0, None)
    beyond = []
    for name, a in ours.items():
        b = theirs[name]
        if not a.is_floating_point():
            assert torch.equal(a, b), f"{what} {name}: {a} vs {b}"
            continue
        scale = b.abs().max().item()
        err = (a.double() - b.double()).abs().max().item()
        rel = err / scale if scale > 0 else err
        if rel > worst[0]:
            worst = (rel, name)
        if rel > tol:
            bad = int(((a - b).abs() > tol * scale).sum())
            message = (f"{what} '{name}': max |ours - torch DDP| = {err:.3g} ({rel:.3g} of its scale "
                       f"{scale:.3g}), {bad} of {a.numel()} elements beyond {tol:g}")
            if not REPORT_ONLY:
                raise AssertionError(message)
            beyond.append(name)
    if REPORT_ONLY:
        print(f"{what}: {len(beyond)} of {len(ours)} beyond {tol:g}, worst {worst[0]:.3g} ({worst[1]}); "
              f"first: {beyond[:4]}", flush=True)
    return worst


def run_variant(VARIANT, rank, device, nccl):
    def seeded_model():
        model, shape, classes = build_model(0)
        return (WithUnused(model) if VARIANT == "unused" else model), shape, classes

    body, shape, classes = seeded_model()
    ref_body, _, _ = seeded_model()
    body, ref_body = body.to(device, DTYPE), ref_body.to(device, DTYPE)
    kwargs = {}
    if VARIANT == "overlap":
        kwargs["overlap_communication"] = True
    if VARIANT == "after":
        kwargs["overlap_communication"] = False
    if VARIANT == "small-buckets":
        kwargs.update(bucket_cap_mb=1, overlap_communication=True)
    if VARIANT == "bf16":
        kwargs["reduce_dtype"] = torch.bfloat16
    buffers = VARIANT != "no-buffers"
    device_ids = [device.index] if device.index is not None else None

    def torch_ddp(module, group):
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, process_group=group,
                                                         broadcast_buffers=buffers,
                                                         find_unused_parameters=VARIANT == "unused")

    if VARIANT == "control":  # torch DDP against itself: how far two identical runs differ
        ours = torch_ddp(body, nccl)
    elif VARIANT == "torch-ddp-smddp":  # the backend under torch's own DDP
        ours = torch_ddp(body, dist.group.WORLD)
    else:
        ours = LegacyDDP(body, broadcast_buffers=buffers, **kwargs)
    theirs = torch_ddp(ref_body, nccl)
    if VARIANT == "bf16":  # the same wire type on torch's side: its bfloat16 compression hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        theirs.register_comm_hook(nccl, bf16_compress_hook)
    # bfloat16 rounding is amplified step after step (BatchNorm models on random data are
    # chaotic): without momentum, each step starts from the wrapper's state (resync below).
    momentum = 0.0 if VARIANT in ("unused", "bf16") else 0.9
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=momentum)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum)
    tol = 2e-2 if VARIANT == "bf16" else 2e-5
    micro_steps = 2 if VARIANT == "nosync" else 1
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)  # this rank's own batches
    worst = (0.0, None)
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        if VARIANT == "unused":
            body.use_branch = ref_body.use_branch = step % 2 == 0
        for micro in range(micro_steps):
            x = torch.randn(*shape, generator=g).to(device, DTYPE)
            y = torch.randint(0, classes, (shape[0],), generator=g).to(device)
            last = micro == micro_steps - 1
            for model in (ours, theirs):
                loss = torch.nn.functional.cross_entropy(model(x), y) / micro_steps
                if last:
                    loss.backward()
                else:
                    with model.no_sync():
                        loss.backward()
        grads = {n: p.grad for n, p in body.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref_body.named_parameters() if p.grad is not None}
        if VARIANT != "unused":  # torch DDP leaves unused parameters' grads as None, ours zeros
            assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
        ref_grads = {n: t for n, t in ref_grads.items()}
        grads = {n: grads[n] for n in ref_grads}
        worst = max(worst, compare(f"step {step} gradient of", grads, ref_grads, tol), key=lambda w: w[0])
        opt.step()
        ref_opt.step()
        worst = max(worst, compare(f"step {step} parameter", dict(body.named_parameters()),
                                   dict(ref_body.named_parameters()), tol), key=lambda w: w[0])
        worst = max(worst, compare(f"step {step} buffer", dict(body.named_buffers()),
                                   dict(ref_body.named_buffers()), tol), key=lambda w: w[0])
        if VARIANT == "bf16" or RESYNC or (device.type == "cuda" and dist.get_world_size() > 2):
            ref_body.load_state_dict(body.state_dict())
            # A copy: load_state_dict keeps tensors already on the right device, and two
            # optimizers sharing one momentum buffer would each advance it.
            ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {rank}: LEGACY VS NCCL OK {MODEL} {VARIANT}: {STEPS} steps, worst relative difference "
          f"{worst[0]:.2g} ({worst[1]})", flush=True)


def main():
    dist.init_process_group("smddp")
    rank = dist.get_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:  # the same comparison on CPU (the engine's path) against torch DDP on Gloo
        device = torch.device("cpu")
    # Deterministic local computation: both copies' local gradients are then bit-identical, so
    # every difference comes from the reduction.
    # (SMDDP_TEST_NONDETERMINISTIC=1 keeps torch's defaults, to see how far they alone differ.)
    if os.environ.get("SMDDP_TEST_NONDETERMINISTIC") != "1":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    nccl = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
    for variant in VARIANTS:
        run_variant(variant, rank, device, nccl)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
