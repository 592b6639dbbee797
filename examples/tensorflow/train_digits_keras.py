"""Data-parallel Keras model.fit on scikit-learn's digits (no download).

The Keras side of the library: DistributedOptimizer reduces gradients inside model.fit's
training step; the callbacks broadcast rank 0's initial state, average the epoch metrics
over all ranks, and warm the learning rate up from lr to lr * size over the first epochs.

    smddprun -np 2 python examples/tensorflow/train_digits_keras.py
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from digits_data import load_digits_arrays  # noqa: E402

import smdistributed.dataparallel.tensorflow.keras as sdp  # noqa: E402

sdp.init()

gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[sdp.local_rank()], 'GPU')


class PrintEpoch(tf.keras.callbacks.Callback):
    """One line per epoch from rank 0 (the metrics are already averaged over all ranks)."""

    def on_epoch_end(self, epoch, logs=None):
        if sdp.rank() == 0:
            print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.4f}, "
                  f"lr {logs['lr']:.5f} on {sdp.size()} processes", flush=True)


def main():
    parser = argparse.ArgumentParser(description="smdistributed.dataparallel Keras digits example")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.001, help="single-process learning rate")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--save", default="digits_cnn.weights.h5", help="weights file written by rank 0 ('' to skip)")
    args = parser.parse_args()
    tf.random.set_seed(1 + sdp.rank())

    (x_train, y_train), (x_test, y_test) = load_digits_arrays()
    # Each rank its own shard, cut to the same length so every rank runs the same steps.
    per_rank = len(x_train) // sdp.size() // args.batch_size * args.batch_size
    x_shard = x_train[sdp.rank()::sdp.size()][:per_rank]
    y_shard = y_train[sdp.rank()::sdp.size()][:per_rank]

    model = tf.keras.Sequential([
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
    scaled_lr = args.lr * sdp.size()
    opt = sdp.DistributedOptimizer(tf.optimizers.Adam(scaled_lr))
    model.compile(optimizer=opt, loss=tf.losses.SparseCategoricalCrossentropy(), metrics=['accuracy'])

    callbacks = [
        # Start every rank from rank 0's weights and optimizer state.
        sdp.callbacks.BroadcastGlobalVariablesCallback(0),
        # Average the epoch's metrics over all ranks (before the callbacks that read them).
        sdp.callbacks.MetricAverageCallback(),
        # lr / size -> lr over the first epochs (large-batch warmup).
        sdp.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=1 if sdp.rank() == 0 else 0),
        PrintEpoch(),
    ]
    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              shuffle=True, verbose=0)

    if sdp.rank() == 0:
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f"test accuracy {accuracy:.4f}", flush=True)
        if args.save:
            model.save_weights(args.save)
            print(f"saved {args.save}", flush=True)


if __name__ == "__main__":
    main()
