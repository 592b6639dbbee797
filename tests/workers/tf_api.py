"""Every row of the TensorFlow API, eagerly and inside tf.function, against single-process numpy.

Usage: tf_api.py [SECTION ...] (default: all). Each rank builds every rank's input from a seed
and checks its own result against a computation without communication. Prints
"CHECK <section> ok" per section and "tf api ok" at the end.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import smdistributed.dataparallel.tensorflow as sdp  # noqa: E402
import smdistributed.dataparallel.tensorflow.keras as sdpk  # noqa: E402
from reference import DTYPES, OPS, assert_close, make_input, reduce_reference  # noqa: E402

tf.get_logger().setLevel("ERROR")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

OP_OF = {"sum": sdp.ReduceOp.SUM, "average": sdp.ReduceOp.AVERAGE, "min": sdp.ReduceOp.MIN,
         "max": sdp.ReduceOp.MAX, "product": sdp.ReduceOp.PRODUCT}


def tf_input(dtype, rank, count, seed, op="sum", shape=None):
    a = make_input(dtype, rank, count, seed, op)
    if dtype == "bfloat16":
        a = a.view(ml_dtypes.bfloat16)
    return tf.constant(a.reshape(shape or (count,)))


def as_ref(dtype, t):
    a = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
    return a.view(np.uint16) if dtype == "bfloat16" else a


def expect_raises(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in error message: {msg}"
        return msg
    raise AssertionError(f"expected {exc.__name__}")


N = R = None


# ---- sections ------------------------------------------------------------------------------


def check_world():
    assert sdp.is_initialized()
    assert sdp.size() == int(os.environ["SMDDP_SIZE"]) and sdp.rank() == int(os.environ["SMDDP_RANK"])
    assert sdp.local_rank() == int(os.environ["SMDDP_LOCAL_RANK"])
    assert sdp.local_size() == int(os.environ["SMDDP_LOCAL_SIZE"])
    assert sdp.cross_size() == 1 and sdp.cross_rank() == 0  # one host
    assert sdp.is_homogeneous()
    expect_raises(sdp.AlreadyInitializedError, sdp.init, "already called")
    expect_raises(RuntimeError, sdp.init, "already called")
    assert sdpk.size() == N and sdpk.rank() == R and sdpk.local_rank() == R
    assert int(sdp.size_op()) == N and int(sdp.rank_op()) == R
    assert sdp.Average is sdp.ReduceOp.AVERAGE and sdp.Sum is sdp.ReduceOp.SUM
    assert sdp.Min is sdp.ReduceOp.MIN and sdp.Max is sdp.ReduceOp.MAX and sdp.Product is sdp.ReduceOp.PRODUCT
    assert not sdp.mpi_threads_supported()


def check_allreduce():
    """dtypes x ops, eager and in one tf.function per dtype (all ops in one graph)."""
    for dtype in DTYPES:
        ops = [op for op in OPS if not (dtype == "bool" and op == "average")]
        xs = {op: tf_input(dtype, R, 15, seed=DTYPES.index(dtype) * 10 + OPS.index(op), op=op, shape=(3, 5))
              for op in ops}
        want = {op: reduce_reference(dtype, op, [make_input(dtype, r, 15, DTYPES.index(dtype) * 10 + OPS.index(op), op)
                                                 for r in range(N)]).reshape(3, 5) for op in ops}
        for op in ops:
            got = sdp.allreduce(xs[op], op=OP_OF[op])
            assert got.dtype == xs[op].dtype and got.shape == (3, 5)
            assert_close(dtype, as_ref(dtype, got), want[op], f"eager allreduce {dtype} {op}")

        @tf.function
        def all_ops(inputs):
            return {op: sdp.allreduce(inputs[op], op=OP_OF[op]) for op in ops}

        got = all_ops(xs)
        for op in ops:
            assert got[op].shape == (3, 5)
            assert_close(dtype, as_ref(dtype, got[op]), want[op], f"tf.function allreduce {dtype} {op}")

    x = tf.constant(np.arange(6, dtype=np.float32) + R)
    total = sum(np.arange(6, dtype=np.float32) + r for r in range(N))
    for mode in ("eager", "function"):
        run = (lambda f: f()) if mode == "eager" else (lambda f: tf.function(f)())
        # The SMDDP signature: allreduce(tensor, param_index, num_params, compression, op).
        got = run(lambda: sdp.allreduce(x, 0, 1, sdp.Compression.none, sdp.ReduceOp.SUM))
        np.testing.assert_allclose(got.numpy(), total)
        # Horovod's spellings: average=False, op=hvd.Sum, strings, pre/post scale, name.
        np.testing.assert_allclose(run(lambda: sdp.allreduce(x, average=False)).numpy(), total)
        np.testing.assert_allclose(run(lambda: sdp.allreduce(x, op=sdp.Average)).numpy(), total / N, rtol=1e-6)
        np.testing.assert_allclose(run(lambda: sdp.allreduce(x, op="sum", name="named")).numpy(), total)
        got = run(lambda: sdp.allreduce(x, op=sdp.Sum, prescale_factor=2.0, postscale_factor=3.0))
        np.testing.assert_allclose(got.numpy(), 6 * total, rtol=1e-6)
        got = run(lambda: sdp.allreduce(x, compression=sdp.Compression.fp16))
        assert got.dtype == tf.float32
        np.testing.assert_allclose(got.numpy(), total / N, rtol=1e-3)
        v = tf.Variable(x)
        np.testing.assert_allclose(run(lambda: sdp.allreduce(v, op=sdp.Sum)).numpy(), total)
    # Scalars.
    np.testing.assert_allclose(sdp.allreduce(tf.constant(float(R)), op=sdp.Sum).numpy(), sum(range(N)))


def check_oob_and_grouped():
    loss = tf.constant(float(R + 1))
    want = sum(r + 1 for r in range(N)) / N
    assert abs(float(sdp.oob_allreduce(loss)) - want) < 1e-6
    assert abs(float(tf.function(lambda: sdp.oob_allreduce(loss))()) - want) < 1e-6
    assert abs(float(sdp.oob_allreduce(loss, op=sdp.ReduceOp.MAX)) - N) < 1e-6

    def inputs(r):
        return [np.full((4, 3), r + 1, np.float32), np.arange(5, dtype=np.float32) * (r + 1),
                np.full((2,), r + 1, np.int64), np.float64(r)]

    mine = [tf.constant(a) for a in inputs(R)]
    want = [sum(inputs(r)[i] for r in range(N)) for i in range(4)]
    c = sdp.runtime.core()
    for mode in ("eager", "function"):
        def fn():
            return sdp.grouped_allreduce(mine, op=sdp.Sum)
        before = c.counters()["submitted"]
        got = fn() if mode == "eager" else tf.function(fn)()
        # One engine operation per dtype (the two float32 tensors travel packed together) and
        # one for the shapes check.
        assert c.counters()["submitted"] - before == 4, c.counters()
        assert isinstance(got, list) and len(got) == 4
        for g, w, t in zip(got, want, mine):
            assert g.dtype == t.dtype and g.shape == t.shape
            np.testing.assert_allclose(g.numpy(), w)
    got = sdp.grouped_allreduce(mine[:2], average=True)
    np.testing.assert_allclose(got[1].numpy(), want[1] / N, rtol=1e-6)


def check_allgather():
    def rows(r):
        return (np.arange((r + 1) * 2, dtype=np.int64).reshape(r + 1, 2) + 100 * r)

    want = np.concatenate([rows(r) for r in range(N)])
    for dtype in ("int64", "float32", "bfloat16", "bool"):
        def cast(a):
            if dtype == "bfloat16":
                return a.astype(np.float32).astype(ml_dtypes.bfloat16)
            return (a % 2 == 0) if dtype == "bool" else a.astype(dtype)

        x = tf.constant(cast(rows(R)))
        got = sdp.allgather(x)
        np.testing.assert_array_equal(np.asarray(got.numpy()), cast(want))

        @tf.function
        def gather(t):
            y = sdp.allgather(t)
            assert y.shape.as_list() == [None, 2], y.shape
            return y

        np.testing.assert_array_equal(np.asarray(gather(x).numpy()), cast(want))
    # A scalar counts as shape [1].
    np.testing.assert_array_equal(sdp.allgather(tf.constant(R)).numpy(), np.arange(N))
    # Differentiable: d/dx of sum_r(w_r * gathered) on rank r = sum over ranks of their w rows for r.
    x = tf.constant(rows(R).astype(np.float32))
    w = [np.random.default_rng(50 + r).normal(size=want.shape).astype(np.float32) for r in range(N)]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = sdp.allgather(x)
        loss = tf.reduce_sum(y * w[R])
    g = tape.gradient(loss, x).numpy()
    start = sum(r + 1 for r in range(R))
    np.testing.assert_allclose(g, sum(w)[start:start + R + 1], rtol=1e-5)


def check_broadcast():
    root = N - 1
    for dtype in ("float32", "float64", "int32", "bfloat16", "uint8", "bool"):
        x = tf_input(dtype, R, 7, seed=3, shape=(7,))
        want = make_input(dtype, root, 7, 3)
        got = sdp.broadcast(x, root)
        assert_close(dtype, as_ref(dtype, got), want, f"broadcast {dtype}")
        got = tf.function(lambda t: sdp.broadcast(t, root_rank=root))(x)
        assert got.shape == (7,)
        assert_close(dtype, as_ref(dtype, got), want, f"tf.function broadcast {dtype}")
    expect_raises(ValueError, lambda: sdp.broadcast(tf.constant(1.0), N), "root_rank")
    # Gradient: the root receives the sum of every rank's upstream gradient, the others zero.
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(sdp.broadcast(x, 0) * float(R + 1))
    g = tape.gradient(loss, x).numpy()
    np.testing.assert_allclose(g, [sum(range(1, N + 1))] * 2 if R == 0 else [0.0, 0.0])


def check_allreduce_gradient():
    x = tf.constant([1.0, 2.0, 3.0]) * (R + 1)
    c = [np.array([1.0, -1.0, 0.5], np.float32) * (r + 2) for r in range(N)]
    for mode in ("eager", "function"):
        def grad(x=x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(sdp.allreduce(x) * c[R])
            return tape.gradient(loss, x)

        g = grad() if mode == "eager" else tf.function(grad)()
        np.testing.assert_allclose(g.numpy(), sum(c) / N, rtol=1e-6)


def check_alltoall():
    # Rank i sends (j + 1 + i) rows to rank j; row values encode (sender, row index).
    def tensor_of(i):
        n = sum(j + 1 + i for j in range(N))
        return np.stack([np.full(3, 1000 * i + k, np.float32) for k in range(n)])

    splits = [j + 1 + R for j in range(N)]
    want = []
    for i in range(N):
        start = sum(j + 1 + i for j in range(R))
        want.append(tensor_of(i)[start:start + R + 1 + i])
    want = np.concatenate(want)
    for mode in ("eager", "function"):
        fn = lambda: sdp.alltoall(tf.constant(tensor_of(R)), splits=tf.constant(splits, tf.int32))  # noqa: E731
        got, recv = fn() if mode == "eager" else tf.function(fn)()
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(recv.numpy(), [R + 1 + i for i in range(N)])
    # Even split by default.
    x = tf.constant(np.arange(N * 2, dtype=np.int32) + 10 * R)
    got, recv = sdp.alltoall(x)
    np.testing.assert_array_equal(got.numpy(), np.concatenate([np.arange(R * 2, R * 2 + 2) + 10 * i
                                                               for i in range(N)]))
    np.testing.assert_array_equal(recv.numpy(), [2] * N)


def check_reducescatter():
    d0 = 2 * N + 1
    inputs = [np.arange(d0 * 3, dtype=np.float32).reshape(d0, 3) * (r + 1) for r in range(N)]
    total = sum(inputs)
    rows = [d0 // N + (1 if r < d0 % N else 0) for r in range(N)]
    start = sum(rows[:R])
    for mode in ("eager", "function"):
        fn = lambda: sdp.reducescatter(tf.constant(inputs[R]), op=sdp.Sum)  # noqa: E731
        got = fn() if mode == "eager" else tf.function(fn)()
        assert got.shape == (rows[R], 3)
        np.testing.assert_allclose(got.numpy(), total[start:start + rows[R]])
    got = sdp.reducescatter(tf.constant(inputs[R]))  # AVERAGE
    np.testing.assert_allclose(got.numpy(), total[start:start + rows[R]] / N, rtol=1e-6)


def check_broadcast_variables():
    root = 1 % N
    def values(r):
        return [np.full((2, 3), r + 0.5, np.float32), np.int64(r * 7), np.arange(4, dtype=np.float64) - r]

    for mode in ("eager", "function"):
        vs = [tf.Variable(v) for v in values(R)]
        if mode == "eager":
            assert sdp.broadcast_variables(vs, root_rank=root) is None
        else:
            tf.function(lambda: sdp.broadcast_variables(vs, root_rank=root))()
        for v, w in zip(vs, values(root)):
            np.testing.assert_array_equal(v.numpy(), w)
    # Keras 3 variables (model and optimizer), with opt.variables() callable as in the seed.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), R, np.float32), np.full((2,), -R, np.float32)])
    opt = keras.optimizers.Adam(0.1)
    opt.build(model.trainable_variables)
    sdp.broadcast_variables(model.variables, root_rank=root)
    sdp.broadcast_variables(opt.variables(), root_rank=root)
    np.testing.assert_array_equal(model.get_weights()[0], np.full((3, 2), root, np.float32))
    assert isinstance(opt.variables, list) and opt.variables() == opt.variables
    # TF1: global variables in a graph, a SessionRunHook; in eager mode, clear errors.
    expect_raises(RuntimeError, lambda: sdp.broadcast_global_variables(0), "broadcast_variables")
    expect_raises(RuntimeError, lambda: sdp.BroadcastGlobalVariablesHook(0), "estimator")
    expect_raises(RuntimeError, lambda: sdpk.broadcast_global_variables(0), "BroadcastGlobalVariablesCallback")
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("g", initializer=tf.constant([float(R), 1.0 + R]))
        op = sdp.broadcast_global_variables(root)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(op)
            np.testing.assert_array_equal(sess.run(v), [root, 1.0 + root])
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("h", initializer=tf.constant([float(R)]))
        hook = sdp.BroadcastGlobalVariablesHook(root)
        with tf.compat.v1.train.SingularMonitoredSession(hooks=[hook]) as sess:
            np.testing.assert_array_equal(sess.run(v), [root])


def check_misc():
    x = tf.constant([1.0, 2.0])
    assert sdp.overlap(x).numpy().tolist() == [1.0, 2.0]
    last = sdp.join()
    assert 0 <= int(last) < N
    assert 0 <= int(tf.function(sdp.join)()) < N
    sdp.barrier()
    obj = sdp.broadcast_object({"rank": R, "list": [1, 2]}, root_rank=0)
    assert obj == {"rank": 0, "list": [1, 2]}
    assert sdp.allgather_object(("r", R)) == [("r", r) for r in range(N)]


# ---- gradients ---------------------------------------------------------------------------


def linear_problem(r):
    rng = np.random.default_rng(10 + r)
    return rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)


W0 = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
B0 = np.array([0.1, -0.2], np.float32)


def local_grads(r, w=W0, b=B0):
    x, y = linear_problem(r)
    w_, b_ = tf.Variable(w), tf.Variable(b)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.matmul(x, w_) + b_ - y) ** 2)
    return [g.numpy() for g in tape.gradient(loss, [w_, b_])]


def check_gradient_tape():
    per_rank = [local_grads(r) for r in range(N)]
    avg = [sum(g[i] for g in per_rank) / N for i in range(2)]
    total = [sum(g[i] for g in per_rank) for i in range(2)]
    x, y = linear_problem(R)
    w, b = tf.Variable(W0), tf.Variable(B0)

    def step(**kw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
        return sdp.DistributedGradientTape(tape, **kw).gradient(loss, [w, b])

    cases = [({}, avg, 1e-6), ({"op": sdp.ReduceOp.SUM}, total, 1e-6),
             ({"compression": sdp.Compression.fp16}, avg, 2e-3),
             ({"gradient_predivide_factor": 2.0}, avg, 1e-6)]
    for mode in ("eager", "function"):
        for kw, want, tol in cases:
            got = step(**kw) if mode == "eager" else tf.function(lambda: step(**kw))()
            for g, wnt in zip(got, want):
                assert g.dtype == tf.float32
                np.testing.assert_allclose(g.numpy(), wnt, rtol=tol, atol=tol)
    # One tape.gradient() in a graph is one hand-off to the engine (one numpy_function op).
    graph = tf.function(lambda: step()).get_concrete_function().graph
    pyfuncs = [op for op in graph.get_operations() if op.type in ("PyFunc", "EagerPyFunc")
               and "SmddpConsistency" not in op.name]  # (the once-per-loop check: consistency.py)
    assert len(pyfuncs) == 1, [op.name for op in pyfuncs]
    # A structure of sources comes back as the same structure; None gradients stay None.
    unused = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
    got = sdp.DistributedGradientTape(tape).gradient(loss, {"w": w, "b": b, "unused": unused})
    assert got["unused"] is None
    np.testing.assert_allclose(got["w"].numpy(), avg[0], rtol=1e-6)
    # A persistent tape, and a local source that is not reduced.
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
    dtape = sdp.DistributedGradientTape(tape)
    dtape.register_local_source(b)
    g_w, g_b = dtape.gradient(loss, [w, b])
    np.testing.assert_allclose(g_w.numpy(), avg[0], rtol=1e-6)
    np.testing.assert_allclose(g_b.numpy(), per_rank[R][1] / N, rtol=1e-6)
    np.testing.assert_allclose(dtape.gradient(loss, w).numpy(), avg[0], rtol=1e-6)
    assert isinstance(dtape, tf.GradientTape)

    # A GradientTape subclass keeps its own gradient() under ours.
    class ScaledTape(tf.GradientTape):
        def gradient(self, target, sources, **kw):
            return [2.0 * g for g in super().gradient(target, sources, **kw)]

    with ScaledTape() as tape:
        loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
    dtape = sdp.DistributedGradientTape(tape)
    assert isinstance(dtape, ScaledTape) and isinstance(dtape, sdp.DistributedGradientTape)
    np.testing.assert_allclose(dtape.gradient(loss, [w])[0].numpy(), 2 * avg[0], rtol=1e-6)


def check_sparse_gradients():
    """Embedding gradients are IndexedSlices: allgathered (or densified) and averaged."""
    table0 = np.random.default_rng(7).normal(size=(10, 3)).astype(np.float32)

    def ids_of(r):
        return np.array([r, 2 * r + 1, 9 - r, r], np.int64) % 10

    def dense_grad(r):
        t = tf.Variable(table0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(t, ids_of(r)) ** 2) * (r + 1)
        return tf.convert_to_tensor(tape.gradient(loss, t)).numpy()

    want = sum(dense_grad(r) for r in range(N)) / N
    table = tf.Variable(table0)
    for mode in ("eager", "function"):
        for sparse_as_dense in (False, True):
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.gather(table, ids_of(R)) ** 2) * (R + 1)
                tape = sdp.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
                return tape.gradient(loss, [table])[0]

            g = step() if mode == "eager" else tf.function(step)()
            assert isinstance(g, tf.IndexedSlices) != sparse_as_dense, type(g)
            if not sparse_as_dense:
                assert g.values.shape[0] == 4 * N
            np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want, rtol=1e-5, atol=1e-6)
    # The same through allreduce(IndexedSlices) with SUM; MIN is refused.
    sl = tf.IndexedSlices(tf.ones((2, 3)) * (R + 1), tf.constant([R, 0], tf.int64), tf.constant([10, 3], tf.int64))
    got = tf.convert_to_tensor(sdp.allreduce(sl, op=sdp.Sum)).numpy()
    want = np.zeros((10, 3), np.float32)
    for r in range(N):
        want[r] += r + 1
        want[0] += r + 1
    np.testing.assert_allclose(got, want)
    expect_raises(NotImplementedError, lambda: sdp.allreduce(sl, op=sdp.Min), "sparse_as_dense")


# ---- training: the seed's shape and the eager variant, against single-process training ----

STEPS, BATCH = 5, 4


def make_model(weights):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    model.set_weights(weights)
    return model


def init_weights(r):
    rng = np.random.default_rng(300 + r)
    return [rng.normal(scale=0.4, size=(8, 16)).astype(np.float32), rng.normal(scale=0.1, size=16).astype(np.float32),
            rng.normal(scale=0.4, size=(16, 4)).astype(np.float32), rng.normal(scale=0.1, size=4).astype(np.float32)]


def batch(r, step):
    rng = np.random.default_rng(1000 + 17 * step + r)
    return rng.normal(size=(BATCH, 8)).astype(np.float32), rng.integers(0, 4, BATCH).astype(np.int64)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def grads_of(model, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def reference_training(mixed_first_step: bool, make_opt):
    """Single process: rank 0's model; the first step either mixes every rank's gradient at
    its own initial weights (the seed broadcasts after step 1) or trains from rank 0's
    weights; every other step trains on the concatenation of all ranks' batches."""
    model = make_model(init_weights(0))
    opt = make_opt()
    for step in range(STEPS):
        if step == 0 and mixed_first_step:
            per_rank = [grads_of(make_model(init_weights(r)), *batch(r, 0)) for r in range(N)]
            grads = [sum(g[i] for g in per_rank) / N for i in range(len(per_rank[0]))]
        else:
            xs, ys = zip(*(batch(r, step) for r in range(N)))
            grads = grads_of(model, np.concatenate(xs), np.concatenate(ys))
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def compare_weights(got, want, what):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=what)


def check_training_seed_shape():
    """The seed's training_step: tf.function, DistributedGradientTape, broadcast after step 1."""
    mnist_model = make_model(init_weights(R))
    loss = LOSS
    opt = tf.optimizers.Adam(0.01)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)
        tape = sdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))
        if first_batch:
            sdp.broadcast_variables(mnist_model.variables, root_rank=0)
            sdp.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    for step in range(STEPS):
        training_step(*batch(R, step), step == 0)
    compare_weights(mnist_model.get_weights(), reference_training(True, lambda: tf.optimizers.Adam(0.01)),
                    "seed-shaped training")


def check_training_eager():
    """Eager tape, broadcast before the first step: exactly training on the concatenated batch."""
    model = make_model(init_weights(R))
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    sdp.broadcast_variables(model.variables, root_rank=0)
    for step in range(STEPS):
        x, y = batch(R, step)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = sdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    compare_weights(model.get_weights(), reference_training(False, lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
                    "eager training")


def check_distributed_optimizer():
    # Custom loop: apply_gradients reduces first (eager and tf.function).
    for mode in ("eager", "function"):
        model = make_model(init_weights(0))
        opt = sdp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        assert isinstance(opt, keras.optimizers.SGD)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        run = step if mode == "eager" else tf.function(step)
        for s in range(STEPS):
            run(*batch(R, s))
        compare_weights(model.get_weights(),
                        reference_training(False, lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
                        f"DistributedOptimizer {mode}")
    # backward_passes_per_step=2: two local passes, then one reduced update (summed passes).
    model = make_model(init_weights(0))
    opt = sdp.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2)

    @tf.function
    def step2(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for s in range(4):
        step2(*batch(R, s))
    assert int(opt.iterations) == 4
    ref = make_model(init_weights(0))
    ref_opt = keras.optimizers.SGD(0.05)
    for s in (0, 2):
        acc = None
        for p in (s, s + 1):
            per_rank = [grads_of(ref, *batch(r, p)) for r in range(N)]
            g = [sum(x[i] for x in per_rank) / N for i in range(4)]
            acc = g if acc is None else [a + b for a, b in zip(acc, g)]
        ref_opt.apply_gradients(zip(acc, ref.trainable_variables))
    compare_weights(model.get_weights(), ref.get_weights(), "backward_passes_per_step=2")
    expect_raises(ValueError, lambda: sdp.DistributedOptimizer(opt), "already")
    expect_raises(TypeError, lambda: sdp.DistributedOptimizer(object()), "Keras optimizer")
    # TF1 optimizer in a graph: minimize() reduces through compute_gradients().
    per_rank = [local_grads(r) for r in range(N)]
    avg_w = sum(g[0] for g in per_rank) / N
    with tf.Graph().as_default():
        x, y = linear_problem(R)
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(W0))
        b = tf.compat.v1.get_variable("b", initializer=tf.constant(B0))
        loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
        opt1 = sdp.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train = opt1.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            np.testing.assert_allclose(sess.run(w), W0 - 0.5 * avg_w, rtol=1e-5, atol=1e-6)


def check_keras_fit():
    """model.fit with the keras DistributedOptimizer and callbacks, from different initial
    weights per rank: equal to single-process training on the concatenated batches."""
    steps_per_epoch, epochs = 3, 2
    xs = [np.concatenate([batch(r, s)[0] for s in range(steps_per_epoch)]) for r in range(N)]
    ys = [np.concatenate([batch(r, s)[1] for s in range(steps_per_epoch)]) for r in range(N)]
    model = make_model(init_weights(R))
    lr = 0.1
    opt = sdpk.DistributedOptimizer(keras.optimizers.SGD(lr))
    model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    seen_lr = []

    class RecordLR(keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            seen_lr.append(float(np.asarray(self.model.optimizer.learning_rate)))

    callbacks = [sdpk.callbacks.BroadcastGlobalVariablesCallback(0), sdpk.callbacks.MetricAverageCallback(),
                 sdpk.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=epochs), RecordLR()]
    hist = model.fit(xs[R], ys[R], batch_size=BATCH, epochs=epochs, shuffle=False, callbacks=callbacks, verbose=0)
    # The warmup: lr/size at the start, rising linearly (Horovod's formula) to lr.
    want_lr = []
    for e in range(epochs):
        for b in range(steps_per_epoch):
            ep = e + b / steps_per_epoch + 1 / steps_per_epoch
            want_lr.append(lr / N * (ep * (N - 1) / epochs + 1))
    np.testing.assert_allclose(seen_lr, want_lr, rtol=1e-6)
    assert abs(want_lr[-1] - lr) < 1e-9
    # Single-process reference with the same learning rates.
    ref = make_model(init_weights(0))
    for e in range(epochs):
        for s in range(steps_per_epoch):
            xb = np.concatenate([xs[r][s * BATCH:(s + 1) * BATCH] for r in range(N)])
            yb = np.concatenate([ys[r][s * BATCH:(s + 1) * BATCH] for r in range(N)])
            g = grads_of(ref, xb, yb)
            for v, gi in zip(ref.trainable_variables, g):
                v.assign(v - want_lr[e * steps_per_epoch + s] * gi)
    compare_weights(model.get_weights(), ref.get_weights(), "model.fit")
    # MetricAverageCallback: every rank's History holds the same (averaged) values.
    all_hist = sdp.allgather_object({k: [round(float(v), 6) for v in vals] for k, vals in hist.history.items()})
    assert all(h == all_hist[0] for h in all_hist), all_hist
    logs = {"loss": float(R), "acc": np.float32(2 * R), "tag": "text"}
    sdpk.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    assert abs(logs["loss"] - (N - 1) / 2) < 1e-9 and abs(logs["acc"] - (N - 1)) < 1e-6 and logs["tag"] == "text"


def _weights_equal_across_ranks(weights, what):
    """Every rank's weights bit-equal to rank 0's (gathered as bytes)."""
    mine = np.concatenate([np.ascontiguousarray(w).view(np.uint8).reshape(-1) for w in weights])
    everyone = sdp.allgather_object(mine.tobytes())
    assert all(b == everyone[0] for b in everyone), f"{what}: ranks' weights differ"


def check_keras_lazy_model():
    """A Sequential without an Input (Horovod's keras MNIST example) has no weights when
    training begins: the callback broadcasts after the first batch, and the ranks, which
    drew different initial weights, end bit-equal. Without the callback the consistency
    check stops the job at the second step, naming a variable, on every rank."""
    xs, ys = zip(*(batch(R, s) for s in range(4)))
    x, y = np.concatenate(xs), np.concatenate(ys)
    for with_callback in (True, False):
        keras.utils.set_random_seed(1000 + R)  # different initial weights on every rank
        model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        assert not model.built
        model.compile(optimizer=sdpk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss=LOSS)
        callbacks = [sdpk.callbacks.BroadcastGlobalVariablesCallback(0)] if with_callback else []
        def fit():
            return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
        if with_callback:
            fit()
            _weights_equal_across_ranks(model.get_weights(), "lazily built Sequential under model.fit")
        else:
            msg = expect_raises(Exception, fit, "ranks hold different values of variable", "SMDDP_CONSISTENCY_CHECK")
            assert "DistributedOptimizer" in msg, msg
    # A custom loop that never broadcasts: the tape's second reduction raises (eagerly).
    model = make_model(init_weights(R))
    for step in range(2):
        with tf.GradientTape() as tape:
            loss = LOSS(batch(R, step)[1], model(batch(R, step)[0]))
        def run():
            return sdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        if step == 0:
            run()
        else:
            msg = expect_raises(sdp.SmddpError, run, "ranks hold different values of variable", "differ from rank 0")
            assert f"ranks {list(range(1, N))}" in msg, msg


def check_errors():
    # Shapes that differ between ranks fail on every rank, eagerly and in a graph.
    msg = expect_raises(sdp.SmddpError, lambda: sdp.allreduce(tf.zeros([R + 2])))
    assert "do not match" in msg and f"float32[{R + 2}]" in msg and "dimension 0" in msg, msg
    print("mismatch message:", msg)
    # Same element count, other shape: still caught (packing hides shapes from the engine).
    msg = expect_raises(sdp.SmddpError, lambda: sdp.grouped_allreduce([tf.zeros([2, 3] if R else [3, 2])]))
    assert "do not match" in msg, msg
    fn = tf.function(lambda: sdp.allreduce(tf.zeros([R + 2, 3])))
    msg = expect_raises(tf.errors.OpError, fn)
    assert "do not match" in msg, msg
    # A tape whose variables differ in shape between ranks.
    v = tf.Variable(tf.ones([3 + R]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    msg = expect_raises(sdp.SmddpError, lambda: sdp.DistributedGradientTape(tape).gradient(loss, [v]))
    assert "do not match" in msg, msg
    expect_raises(TypeError, lambda: sdp.allreduce(tf.constant([1 + 2j])), "dtype")
    expect_raises(NotImplementedError, lambda: sdp.allreduce(tf.ones(2), op=sdp.Adasum), "Adasum")
    expect_raises(NotImplementedError, lambda: sdp.allreduce(tf.ones(2), process_set=object()), "process sets")
    # The engine is still usable.
    np.testing.assert_allclose(sdp.allreduce(tf.ones(3), op=sdp.Sum).numpy(), [N] * 3)


def check_missing_rank():
    """A rank that never submits a gradient: the others fail after SMDDP_TIMEOUT naming it,
    inside tf.function, then everyone goes on (the missing rank waits outside the engine)."""
    sync = os.environ["SYNC_DIR"]
    v = tf.Variable(tf.ones([4]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        return sdp.DistributedGradientTape(tape).gradient(loss, [v])

    if R != N - 1:
        msg = expect_raises(tf.errors.OpError, step)
        assert f"rank(s) {N - 1}" in msg or f"rank {N - 1}" in msg, msg
        open(os.path.join(sync, f"failed.{R}"), "w").close()
    else:
        while not all(os.path.exists(os.path.join(sync, f"failed.{r}")) for r in range(N - 1)):
            time.sleep(0.05)
    np.testing.assert_allclose(sdp.allreduce(tf.ones(2), op=sdp.Sum).numpy(), [N] * 2)


SECTIONS = {
    "world": check_world, "allreduce": check_allreduce, "oob_grouped": check_oob_and_grouped,
    "allgather": check_allgather, "broadcast": check_broadcast, "allreduce_grad": check_allreduce_gradient,
    "alltoall": check_alltoall, "reducescatter": check_reducescatter,
    "broadcast_variables": check_broadcast_variables, "misc": check_misc, "tape": check_gradient_tape,
    "sparse": check_sparse_gradients, "train_seed": check_training_seed_shape, "train_eager": check_training_eager,
    "optimizer": check_distributed_optimizer, "keras_fit": check_keras_fit,
    "keras_lazy": check_keras_lazy_model, "errors": check_errors,
    "missing": check_missing_rank,
}
DEFAULT = [name for name in SECTIONS if name not in ("errors", "missing")]


def main(names):
    global N, R
    expect_raises(sdp.NotInitializedError, sdp.rank, "init()")
    sdp.init()
    N, R = sdp.size(), sdp.rank()
    for name in names or DEFAULT:
        t0 = time.perf_counter()
        SECTIONS[name]()
        print(f"CHECK {name} ok ({time.perf_counter() - t0:.2f}s)", flush=True)
    sdp.shutdown()
    sdp.shutdown()  # safe twice
    assert not sdp.is_initialized()
    expect_raises(sdp.NotInitializedError, sdp.size, "shut down")
    print("tf api ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
