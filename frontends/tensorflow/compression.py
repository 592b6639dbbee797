"""Gradient compression for the wire: `Compression.none` and `Compression.fp16`.

A compressor turns a tensor into what is sent (`compress` -> tensor, context) and back
(`decompress`). fp16 casts floating tensors of other widths to float16 before the
reduction (the engine accumulates float16 in float32 and rounds once) and casts the
result back; other tensors pass unchanged.
"""
import abc

import tensorflow as tf


class Compressor(abc.ABC):
    """Interface (as in Horovod): staticmethods `compress(tensor) -> (tensor, ctx)` and
    `decompress(tensor, ctx)`. Users may subclass it for their own wire formats."""

    @staticmethod
    @abc.abstractmethod
    def compress(tensor):
        """Returns (tensor to send, context for decompress)."""

    @staticmethod
    @abc.abstractmethod
    def decompress(tensor, ctx):
        """Returns the tensor as the caller gave it, from what was received."""


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating tensors as float16."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The available compressors (Horovod's and SMDDP's spelling)."""

    none = NoneCompressor
    fp16 = FP16Compressor
