"""smp.nn: the original's replacement for apex's FusedLayerNorm.

torch's own layer norm is one fused kernel on GPUs, so FusedLayerNorm is torch.nn.LayerNorm
under apex's signature; it needs no apex. The original's tensor-parallel modules
(smp.nn.DistributedLinear, DistributedTransformer, ...) are not part of this library.
"""
import torch


class FusedLayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False):
        """`memory_efficient` (apex: recompute in the backward instead of saving) changes no
        result and is accepted for apex's scripts."""
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)


def tensor_parallelism_unsupported(name: str) -> AttributeError:
    """The error for a name of the original's tensor-parallel API (smp.nn.* and smp.*)."""
    return AttributeError(f"{name}: tensor parallelism is not supported by this implementation of "
                          "smdistributed.modelparallel (pipeline and data parallelism are)")


def __getattr__(name: str):
    if name.startswith("Distributed"):
        raise tensor_parallelism_unsupported(f"smp.nn.{name}")
    raise AttributeError(f"module 'smdistributed.modelparallel.torch.nn' has no attribute '{name}'")
