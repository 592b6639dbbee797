"""A Horovod TF2 training script (the shape of Horovod's tensorflow2 MNIST example) with only
its import changed: `import horovod.tensorflow as hvd` became the line below. The data are
scikit-learn's digits instead of a download. Run under smddprun; each rank prints a
checksum of its final weights, which must agree."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import smdistributed.dataparallel.tensorflow as hvd  # noqa: E402


def main():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    digits = load_digits()
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(digits.images[..., tf.newaxis] / 16.0, tf.float32),
         tf.cast(digits.target, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])
    loss = tf.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    checkpoint_dir = './checkpoints'
    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch:
            hvd.broadcast_variables(mnist_model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)

        return loss_value

    # Horovod: adjust number of steps based on number of GPUs.
    for batch, (images, labels) in enumerate(dataset.take(60 // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)

        if batch % 10 == 0 and hvd.local_rank() == 0:
            print('Step #%d\tLoss: %.6f' % (batch, loss_value))

    # Other Horovod calls such scripts make: an averaged metric, a gathered tensor, a
    # broadcast Python object, a final join.
    avg_loss = hvd.allreduce(tf.constant(float(loss_value)), average=True, name="avg_loss")
    ranks = hvd.allgather(tf.constant([hvd.rank()]))
    config = hvd.broadcast_object({"lr": 0.001 * hvd.size()}, root_rank=0)
    assert ranks.numpy().tolist() == list(range(hvd.size())) and config["lr"] == 0.001 * hvd.size()
    hvd.join()

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting it.
    if hvd.rank() == 0:
        checkpoint.save(checkpoint_dir)
        print('Average loss %.6f; checkpoint saved' % float(avg_loss))
    checksum = float(sum(np.sum(np.abs(w)) for w in mnist_model.get_weights()))
    print('rank %d of %d: weights checksum %.6f' % (hvd.rank(), hvd.size(), checksum), flush=True)


if __name__ == '__main__':
    main()
