"""The shared bucketing planner (smdistributed.common.bucket_plan), in process.

Its two users must get the buckets they made before they shared it: the TensorFlow
frontend's grouped reduction (dtype-separate open buckets, 64-byte aligned room, tensors of
the cap or more alone) and the older torch DistributedDataParallel's GPU buckets (reverse
order, a small first bucket, a dtype change closes a bucket, no cap after backward). The
layouts are pinned by hand and against those rules as they were written inline before.
"""
import random

import pytest

from smdistributed.common.bucket_plan import FIRST_BUCKET_BYTES, padded, plan_buckets

MB = 1 << 20


# ---- the rules each user had inline before the planner (the reference) --------------------


def tf_rule(nbytes, dtypes, cap):
    """ops._submit_dense's loop: (tensors alone, buckets of (index, offset))."""
    alone, buckets, open_of = [], [], {}
    for i, (n, dt) in enumerate(zip(nbytes, dtypes)):
        if n == 0:
            continue
        if n >= cap:
            alone.append(i)
            continue
        b = open_of.get(dt)
        if b is None or b["bytes"] + (n + 63) // 64 * 64 > cap:
            b = {"bytes": 0, "members": []}
            open_of[dt] = b
            buckets.append(b)
        b["members"].append((i, b["bytes"]))
        b["bytes"] += (n + 63) // 64 * 64
    return alone, [b["members"] for b in buckets]


def gpu_rule(nbytes, dtypes, cap, overlap=True):
    """GpuGradientBuckets.__init__'s loop: buckets of indices."""
    if not overlap:
        cap = 1 << 62
    limit, group, size, out = min(FIRST_BUCKET_BYTES, cap), [], 0, []
    for i in reversed(range(len(nbytes))):
        if group and (size + nbytes[i] > limit or dtypes[group[0]] != dtypes[i]):
            out.append(group)
            group, size, limit = [], 0, cap
        group.append(i)
        size += nbytes[i]
    if group:
        out.append(group)
    return out


# ---- how each user calls the planner -----------------------------------------------------


def tf_plan(nbytes, dtypes, cap):
    small = [i for i, n in enumerate(nbytes) if 0 < n < cap]
    alone = [i for i, n in enumerate(nbytes) if n >= cap]
    buckets = []
    for b in plan_buckets([nbytes[i] for i in small], [dtypes[i] for i in small], cap, align=64):
        members, off = [], 0
        for j in b:
            members.append((small[j], off))
            off += padded(nbytes[small[j]], 64)
        buckets.append(members)
    return alone, buckets


def gpu_plan(nbytes, dtypes, cap, overlap=True):
    return plan_buckets(nbytes, dtypes, cap if overlap else 1 << 62, first_cap=FIRST_BUCKET_BYTES, reverse=True,
                        dtype_runs=True)


# ---- pinned layouts ------------------------------------------------------------------------


def test_tf_layout_pinned():
    f4, f8, i8 = "float32", "float64", "int64"
    nbytes = [4, 40, 100, 0, 70, 8, 30, 1000]
    dtypes = [f4, f4, f8, f4, f8, i8, f4, f4]
    # cap 100: tensor 2 (100 B) and 7 go alone, 3 is empty; float32 4 B + 40 B fill 128 B of
    # room (each padded to 64), so each opens its own bucket; dtypes keep separate buckets.
    assert tf_plan(nbytes, dtypes, 100) == ([2, 7], [[(0, 0)], [(1, 0)], [(4, 0)], [(5, 0)], [(6, 0)]])
    assert tf_plan(nbytes, dtypes, 200) == ([7], [[(0, 0), (1, 64), (6, 128)], [(2, 0)], [(4, 0)], [(5, 0)]])
    assert tf_plan(nbytes, dtypes, 25 * MB) == ([], [[(0, 0), (1, 64), (6, 128), (7, 192)], [(2, 0), (4, 128)],
                                                     [(5, 0)]])


def test_gpu_layout_pinned():
    # A transformer-like parameter list: float32 norms between bfloat16 weights.
    nbytes = [4 * MB, 2 * MB, 8 * 1024, 3 * MB, 3 * MB, 8 * 1024, 512 * 1024, 600 * 1024]
    dtypes = ["bf16", "bf16", "f32", "bf16", "bf16", "f32", "bf16", "bf16"]
    # Overlapped, cap 5 MB: from the last parameter; the first bucket holds 1 MB at most.
    assert gpu_plan(nbytes, dtypes, 5 * MB) == [[7], [6], [5], [4], [3], [2], [1], [0]]
    assert gpu_plan(nbytes, dtypes, 7 * MB) == [[7], [6], [5], [4, 3], [2], [1, 0]]
    # After backward (no cap): still a first bucket of at most 1 MB, then runs of one dtype.
    assert gpu_plan(nbytes, dtypes, 5 * MB, overlap=False) == [[7], [6], [5], [4, 3], [2], [1, 0]]
    same = [100 * 1024] * 30
    assert gpu_plan(same, ["f32"] * 30, 25 * MB) == [list(range(29, 19, -1)), list(range(19, -1, -1))]


@pytest.mark.parametrize("seed", range(200))
def test_users_get_their_previous_layouts(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 40)
    kinds = rng.choice([["f32"], ["f32", "bf16"], ["f32", "f64", "i64", "f16"]])
    scale = rng.choice([64, 4096, MB])
    nbytes = [rng.choice([0, 1, 4, 63, 64, 65]) if rng.random() < 0.2 else rng.randint(1, 4 * scale)
              for _ in range(n)]
    dtypes = [rng.choice(kinds) for _ in range(n)]
    cap = rng.choice([64, 100, 1000, scale, 3 * scale, 25 * MB])
    assert tf_plan(nbytes, dtypes, cap) == tf_rule(nbytes, dtypes, cap)
    for overlap in (True, False):
        assert gpu_plan(nbytes, dtypes, cap, overlap) == gpu_rule(nbytes, dtypes, cap, overlap)


def test_planner_options():
    sizes, kinds = [10, 10, 10, 10], ["a", "b", "a", "b"]
    assert plan_buckets(sizes, kinds, 100) == [[0, 2], [1, 3]]
    assert plan_buckets(sizes, kinds, 100, dtype_runs=True) == [[0], [1], [2], [3]]
    assert plan_buckets(sizes, kinds, 100, reverse=True) == [[3, 1], [2, 0]]
    assert plan_buckets([10] * 5, ["a"] * 5, 30, first_cap=10) == [[0], [1, 2, 3], [4]]
    assert plan_buckets([10] * 3, ["a"] * 3, 30, first_cap=1000) == [[0, 1, 2]]  # never above the cap
    assert plan_buckets([50, 10], ["a", "a"], 30) == [[0], [1]]  # larger than the cap: its own bucket
    assert plan_buckets([1, 1], ["a", "a"], 64, align=64) == [[0], [1]]
    assert plan_buckets([], [], 10) == []
    with pytest.raises(ValueError):
        plan_buckets([1], [], 10)


# ---- the users themselves ------------------------------------------------------------------


def test_tensorflow_frontend_uses_the_planner():
    pytest.importorskip("tensorflow")
    import numpy as np

    from smdistributed.dataparallel.tensorflow.buckets import layout

    nbytes = [4, 40, 100, 0, 70, 8, 30, 1000]
    dtypes = [np.dtype(d) for d in ("f4", "f4", "f8", "f4", "f8", "i8", "f4", "f4")]
    alone, packed = layout(nbytes, dtypes, 200)
    assert alone == [7]
    assert [b.members for b in packed] == [[(0, 0), (1, 64), (6, 128)], [(2, 0)], [(4, 0)], [(5, 0)]]
    assert [b.nbytes for b in packed] == [192, 128, 128, 64]


@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_buckets_use_the_planner(overlap):
    """GpuGradientBuckets builds its buckets without touching a GPU (CPU parameters here)."""
    torch = pytest.importorskip("torch")
    from smdistributed.dataparallel.torch.parallel.gpu_buckets import GpuGradientBuckets

    # test_gpu_layout_pinned's sizes: bfloat16 weights around float32 norms.
    shapes = [(2048, 1024), (1024, 1024), (2048,), (1536, 1024), (1536, 1024), (2048,), (256, 1024), (300, 1024)]
    kinds = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
             torch.bfloat16, torch.bfloat16]
    params = {f"p{i}": torch.nn.Parameter(torch.zeros(s, dtype=d)) for i, (s, d) in enumerate(zip(shapes, kinds))}
    buckets = GpuGradientBuckets(params, None, 5 * MB, overlap=overlap)
    index = {id(p): i for i, p in enumerate(params.values())}
    got = [[index[id(p)] for p in b.params] for b in buckets._buckets]
    nbytes = [p.numel() * p.element_size() for p in params.values()]
    assert got == gpu_rule(nbytes, [str(d) for d in kinds], 5 * MB, overlap)
    assert got == ([[7], [6], [5], [4], [3], [2], [1], [0]] if overlap else [[7], [6], [5], [4, 3], [2], [1, 0]])
