"""Gradient compression for the wire: `Compression.none` and `Compression.fp16`.

A compressor turns a tensor into what is sent (`compress` -> tensor, context) and back
(`decompress`). fp16 casts floating tensors of other widths to float16 before the
reduction (the engine accumulates float16 in float32 and rounds once) and casts the
result back; other tensors pass unchanged.
"""
import tensorflow as tf


class Compressor:
    """Interface: staticmethods `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx)`."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


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
