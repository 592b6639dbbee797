"""scikit-learn's bundled digits for the TensorFlow examples (no download)."""
import numpy as np


def load_digits_arrays():
    """The 1,797 8x8 digits, split 80/20, scaled to [0, 1], NHWC."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images[..., np.newaxis] / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    split = int(len(labels) * 0.8)
    return (images[:split], labels[:split]), (images[split:], labels[split:])
