"""Keras 2 scripts (tf-keras, TF_USE_LEGACY_KERAS=1 set by the test) through the library:
model.fit with DistributedOptimizer and the callbacks against single-process training, the
original library's TF2 Keras example shape (a Sequential without Input, compile with
experimental_run_tf_function=False, model.save to a directory), a DistributedGradientTape
loop, and the consistency check.
"""
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

import smdistributed.dataparallel.tensorflow.keras as sdpk
import smdistributed.dataparallel.tensorflow as sdp

assert tf.keras.__name__.startswith("tf_keras"), "run with TF_USE_LEGACY_KERAS=1 and tf-keras installed"
tf.config.threading.set_intra_op_parallelism_threads(1)
sdp.init()
N, R = sdp.size(), sdp.rank()
BATCH, STEPS = 4, 3


def batch(r, step):
    rng = np.random.default_rng(1000 + 17 * step + r)
    return rng.normal(size=(BATCH, 8)).astype(np.float32), rng.integers(0, 4, BATCH).astype(np.int64)


def data(r):
    xs, ys = zip(*(batch(r, s) for s in range(STEPS)))
    return np.concatenate(xs), np.concatenate(ys)


def make_model(seed, with_input=True):
    tf.keras.utils.set_random_seed(seed)
    layers = [tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(4)]
    if with_input:
        layers.insert(0, tf.keras.Input((8,)))
    return tf.keras.Sequential(layers)


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference(weights, lr=0.1):
    """One process, SGD on the concatenation of every rank's batch at each step."""
    model = make_model(0)
    model.set_weights(weights)
    for step in range(STEPS):
        xs, ys = zip(*(batch(r, step) for r in range(N)))
        with tf.GradientTape() as tape:
            loss = LOSS(np.concatenate(ys), model(np.concatenate(xs), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            v.assign(v - lr * g)
    return model.get_weights()


def equal_across_ranks(weights, what):
    mine = b"".join(np.ascontiguousarray(w).tobytes() for w in weights)
    everyone = sdp.allgather_object(mine)
    assert all(b == everyone[0] for b in everyone), f"{what}: ranks differ"


def check_fit_matches_single_process():
    model = make_model(100 + R)  # different initial weights: the callback broadcasts rank 0's
    init0 = sdp.broadcast_object(model.get_weights() if R == 0 else None, root_rank=0)
    opt = sdpk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    assert isinstance(opt, tf.keras.optimizers.SGD)
    model.compile(loss=LOSS, optimizer=opt, metrics=["accuracy"], experimental_run_tf_function=False)
    x, y = data(R)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[sdpk.callbacks.BroadcastGlobalVariablesCallback(0), sdpk.callbacks.MetricAverageCallback()])
    for got, want in zip(model.get_weights(), reference(init0)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def check_original_example_shape():
    """The original library's TF2 Keras example: no Input layer, compile(...,
    experimental_run_tf_function=False), the callbacks, a SavedModel directory on rank 0."""
    model = make_model(200 + R, with_input=False)
    opt = sdpk.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * N))
    model.compile(loss=LOSS, optimizer=opt, metrics=["accuracy"], experimental_run_tf_function=False)
    callbacks = [sdpk.callbacks.BroadcastGlobalVariablesCallback(0), sdpk.callbacks.MetricAverageCallback(),
                 sdpk.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * N, warmup_epochs=1, verbose=0)]
    x, y = data(R)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    equal_across_ranks(model.get_weights(), "lazily built Sequential (Keras 2)")
    if R == 0:
        with tempfile.TemporaryDirectory() as d:
            model.save(os.path.join(d, "model"))  # Keras 2: a SavedModel directory
            assert os.path.isdir(os.path.join(d, "model"))


def check_tape_loop():
    model = make_model(0)
    init = model.get_weights()
    opt = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        tape = sdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(STEPS):
        step(*batch(R, s))
    for got, want in zip(model.get_weights(), reference(init)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def check_inconsistent_ranks_raise():
    model = make_model(300 + R, with_input=False)
    model.compile(loss=LOSS, optimizer=sdpk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
    x, y = data(R)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # no broadcast callback
    except Exception as e:  # noqa: BLE001 - raised inside the train function
        assert "ranks hold different values of variable" in str(e), e
    else:
        raise AssertionError("ranks trained different weights without an error")


def main():
    for check in (check_fit_matches_single_process, check_original_example_shape, check_tape_loop,
                  check_inconsistent_ranks_raise):
        check()
        print(f"CHECK {check.__name__} ok", flush=True)
    print(f"rank {R}: KERAS 2 OK", flush=True)
    sdp.shutdown()


if __name__ == "__main__":
    sys.exit(main())
