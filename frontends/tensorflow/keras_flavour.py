"""Which Keras this process trains with.

TensorFlow 2.16+ ships Keras 3 as `tf.keras`; scripts written for Keras 2 keep running with
the `tf-keras` package and `TF_USE_LEGACY_KERAS=1`, which makes `tf.keras` that package. The
frontend follows `tf.keras`, so its optimizer wrapper and callbacks are of the flavour the
user's model is.
"""
from __future__ import annotations

import tensorflow as tf


def keras():
    """The Keras module `tf.keras` resolves to in this process."""
    return tf.keras


def is_keras2() -> bool:
    return keras().__name__.startswith("tf_keras")


def optimizer_base_classes() -> tuple:
    """The optimizer base classes of this flavour (Keras 2 also has its legacy optimizers)."""
    k = keras()
    bases = [k.optimizers.Optimizer]
    legacy = getattr(getattr(k.optimizers, "legacy", None), "Optimizer", None)
    if is_keras2() and legacy is not None:
        bases.append(legacy)
    return tuple(bases)
