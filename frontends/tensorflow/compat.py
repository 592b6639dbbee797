"""Keeps the documented TF2 scripts running on Keras 3.

The SMDDP and Horovod TF2 examples call `opt.variables()`: a method of the Keras 2
optimizers of TF <= 2.15. Keras 3 (TF 2.16+) made `variables` a property returning a list,
so the call raises "'list' object is not callable". `install()` (run by init()) makes the
property return a list that may also be called, returning itself. Nothing else changes:
it is still a list of the same variables. Set SMDDP_TF_KERAS_COMPAT=0 to leave Keras alone.
"""
from __future__ import annotations

_installed = False


class VariableList(list):
    """A list of variables that can also be called (Keras 2's `optimizer.variables()`)."""

    def __call__(self):
        return self


def install() -> None:
    global _installed
    if _installed:
        return
    try:
        from keras.src.optimizers import base_optimizer
    except ImportError:
        return
    classes = {base_optimizer.BaseOptimizer}
    try:
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

        classes.add(LossScaleOptimizer)
    except ImportError:
        pass
    for cls in classes:
        prop = cls.__dict__.get("variables")
        if not isinstance(prop, property) or getattr(prop.fget, "_sdp_callable_list", False):
            continue

        def make(fget):
            def variables(self):
                return VariableList(fget(self))

            variables._sdp_callable_list = True
            variables.__doc__ = fget.__doc__
            return property(variables)

        setattr(cls, "variables", make(prop.fget))
    _installed = True
