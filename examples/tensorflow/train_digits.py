"""The SageMaker data parallel TensorFlow 2 example, on scikit-learn's bundled digits (no download).

Shaped exactly like the library's documented TF2 script: init, one GPU per process where
there are GPUs, the learning rate scaled by the world size, DistributedGradientTape inside a
tf.function training step, model and optimizer variables broadcast from rank 0 after the
first step, a checkpoint written by rank 0 only. Each rank trains on its own shard.

    smddprun -np 2 python examples/tensorflow/train_digits.py
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from digits_data import load_digits_arrays  # noqa: E402

# SageMaker data parallel: Import the library TF API
import smdistributed.dataparallel.tensorflow as sdp  # noqa: E402

# SageMaker data parallel: Initialize the library
sdp.init()

gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    # SageMaker data parallel: Pin GPUs to a single library process
    tf.config.experimental.set_visible_devices(gpus[sdp.local_rank()], 'GPU')


def main():
    parser = argparse.ArgumentParser(description="smdistributed.dataparallel TF2 digits example")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.001, help="single-process learning rate")
    parser.add_argument("--checkpoint-dir", default="./checkpoints", help="'' to skip the checkpoint")
    args = parser.parse_args()
    tf.random.set_seed(1 + sdp.rank())  # different initial weights per rank: the broadcast aligns them

    # Prepare Dataset: each rank its own shard, the same number of steps on every rank.
    (x_train, y_train), (x_test, y_test) = load_digits_arrays()
    steps_per_epoch = len(x_train) // (args.batch_size * sdp.size())
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(sdp.size(), sdp.rank())
               .shuffle(2048, seed=sdp.rank(), reshuffle_each_iteration=True)
               .batch(args.batch_size, drop_remainder=True)
               .take(steps_per_epoch))

    # Define Model
    mnist_model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Conv2D(64, 3, activation='relu'),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax'),
    ])
    loss = tf.losses.SparseCategoricalCrossentropy()

    # SageMaker data parallel: Scale Learning Rate
    opt = tf.optimizers.Adam(args.lr * sdp.size())

    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # SageMaker data parallel: Wrap tf.GradientTape with the library's DistributedGradientTape
        tape = sdp.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        if first_batch:
            # SageMaker data parallel: Broadcast model and optimizer variables
            sdp.broadcast_variables(mnist_model.variables, root_rank=0)
            sdp.broadcast_variables(opt.variables(), root_rank=0)

        return loss_value

    for epoch in range(1, args.epochs + 1):
        start, total, batches = time.perf_counter(), 0.0, 0
        for batch, (images, labels) in enumerate(dataset):
            loss_value = training_step(images, labels, epoch == 1 and batch == 0)
            total += float(loss_value)
            batches += 1
        # SageMaker data parallel: average the epoch's loss over all ranks (out of band).
        mean_loss = float(sdp.oob_allreduce(tf.constant(total / batches)))
        elapsed = time.perf_counter() - start
        if sdp.rank() == 0:
            samples = batches * args.batch_size * sdp.size()
            print(f"epoch {epoch}: loss {mean_loss:.4f}, {samples / elapsed:,.0f} samples/s "
                  f"on {sdp.size()} processes", flush=True)

    if sdp.rank() == 0:
        probs = mnist_model(x_test, training=False)
        accuracy = float(np.mean(np.argmax(probs, axis=1) == y_test))
        print(f"test accuracy {accuracy:.4f} ({int(round(accuracy * len(y_test)))}/{len(y_test)})", flush=True)

    # SageMaker data parallel: Save checkpoints only from master node.
    if sdp.rank() == 0 and args.checkpoint_dir:
        path = checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
        print(f"saved {path}", flush=True)


if __name__ == "__main__":
    main()
