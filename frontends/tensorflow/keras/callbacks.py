"""Keras callbacks for data-parallel model.fit (Horovod's set)."""
from __future__ import annotations

import numpy as np

from ..keras_flavour import keras as _keras_module

keras = _keras_module()  # Keras 3, or tf-keras under TF_USE_LEGACY_KERAS=1: the model's flavour

# After the flavour is chosen: these modules import keras themselves.
from .. import consistency as _consistency  # noqa: E402
from .. import ops as _ops  # noqa: E402
from ..runtime import core, size  # noqa: E402


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank train from `root_rank`'s model and optimizer state.

    At the start of training it broadcasts the variables that exist then, so that the first
    step already starts from the same weights when the model is built. A model built by its
    first batch (a `Sequential` without an `Input`) and the optimizer's state exist only
    after that batch: at its end everything (model and optimizer variables) is broadcast
    again, as Horovod's callback does, so the ranks agree from the second step on. After
    the second batch the ranks compare checksums of their trainable and optimizer variables
    once and raise, naming the first that differs, if they do not agree
    (`SMDDP_CONSISTENCY_CHECK=0` skips it). Once per callback object, like Horovod's.
    """

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._batches_after_broadcast = None  # counts batches after the full broadcast

    def _optimizer_variables(self):
        opt = getattr(self.model, "optimizer", None)
        if opt is None or not getattr(opt, "built", True):
            return []
        variables = opt.variables
        return list(variables() if callable(variables) else variables)  # a method in Keras 2

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        if self.model.built and self.model.variables:
            _ops.broadcast_variables(list(self.model.variables) + self._optimizer_variables(), self.root_rank)

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            _ops.broadcast_variables(list(self.model.variables) + self._optimizer_variables(), self.root_rank)
            self.broadcast_done = True
            self._batches_after_broadcast = 0
            return
        if self._batches_after_broadcast is not None:
            self._batches_after_broadcast += 1
            if self._batches_after_broadcast == 1:
                self._batches_after_broadcast = None
                if _consistency.enabled():
                    # Trainable and optimizer state only: non-trainable variables (BatchNorm
                    # statistics) follow each rank's own batches.
                    _consistency.check_variables(list(self.model.trainable_variables) + self._optimizer_variables(),
                                                 "BroadcastGlobalVariablesCallback, after the second batch")


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics (the `logs` of on_epoch_end) over all ranks, so that
    callbacks after it (checkpointing, early stopping, the History) see global values.
    Every rank must report the same metric names."""

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        c = core()
        works, values = [], []
        for k in keys:
            arr = np.array([float(np.asarray(logs[k]))], np.float64)
            works.append(c.allreduce(arr, "average", name=f"tf.keras.metric.{k}", async_op=True))
            values.append(arr)
        for w in works:
            w.wait()
        for k, arr in zip(keys, values):
            logs[k] = float(arr[0])


def _is_number(v) -> bool:
    try:
        a = np.asarray(v)
    except Exception:  # noqa: BLE001
        return False
    return a.size == 1 and (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` between `start_epoch` and
    `end_epoch` (Horovod's semantics). With `staircase=True` the multiplier is evaluated at
    each epoch's start with an integer epoch; otherwise at every batch with a fractional
    epoch (epoch + batch / steps_per_epoch). `multiplier` may be a constant.
    `momentum_correction` is accepted: Keras 3 optimizers compile their momentum as a
    constant, so it cannot be corrected during training (a no-op here)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=multiplier: m)

    def _active(self, epoch) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set_lr(self, epoch) -> None:
        lr = self.initial_lr * self.multiplier(epoch)
        self.model.optimizer.learning_rate = lr

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = float(np.asarray(self.model.optimizer.learning_rate))
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError("pass steps_per_epoch= (model.fit was not given the number of steps per epoch)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set_lr(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or self.current_epoch is None or not self._active(self.current_epoch):
            return
        self._set_lr(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size()` up to `initial_lr` over the first
    `warmup_epochs` epochs, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD";
    Horovod's formula). `initial_lr` is the already scaled rate (e.g. 0.001 * size())."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        self.warmup_epochs = warmup_epochs

        def multiplier(epoch):
            # Reaches 1.0 at the end of the last warmup batch.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self.model.optimizer.learning_rate)):g}.")
