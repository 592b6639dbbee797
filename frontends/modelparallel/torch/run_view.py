"""What a graphed run's checks read of its modules, at every call, at C speed.

A replay of a captured run (stage_graphs.py) is right only while nothing its capture took as
fixed has changed: each submodule's mode, which parameters it has, their tensors and
requires_grad, its buffers' tensors; and a run with hooks or an activation-checkpointing mark
must not replay at all (a replay skips their Python). Both checks run on the compute token's
path at every graphed call. Walking the module tree for them in Python cost 0.2 and 0.09 ms a
call for 8 encoder layers on an H200 host (session 30), about a tenth of the last stage's host
work a microbatch.

A view walks the tree once and keeps its submodules and their instance dicts. At each call it
reads every submodule's children, parameters, buffers and hook dicts afresh through those
instance dicts, with map and chain (loops in C, no Python frame per module), and walks again
only if the children changed (compared by identity): a submodule replaced, added or removed
anywhere in the run. A dict replaced wholesale (`m._parameters = {...}`, hooks swapped out and
back) is read as it is now. So the checks are as exact as the full walk.
"""
from __future__ import annotations

import functools
import itertools
import operator
from typing import List, Sequence

import torch
import torch.nn as nn

_chain = itertools.chain.from_iterable
_present = functools.partial(operator.is_not, None)  # a registered name may hold None
_training = operator.attrgetter("training")
_requires_grad = operator.attrgetter("requires_grad")
_data_ptr = torch.Tensor.data_ptr
_checkpoint_mark = operator.methodcaller("get", "_smp_checkpoint")  # activation_checkpointing.py
_children = operator.itemgetter("_modules")
_params = operator.itemgetter("_parameters")
_buffers = operator.itemgetter("_buffers")
_hooks = operator.itemgetter("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# A parameter's own hooks (Tensor.register_hook, register_post_accumulate_grad_hook): None, or a
# dict that is empty once they were removed.
_param_hooks = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")
_shape = operator.attrgetter("shape")
# Hooks registered for every module (torch.nn.modules.module.register_module_forward_hook and
# the like, used by profilers and flop counters): a replay would skip them too.
_global_hooks = operator.attrgetter("_global_forward_hooks", "_global_forward_pre_hooks",
                                    "_global_backward_hooks", "_global_backward_pre_hooks")
_SCALARS = (bool, int, float, str, type(None))  # plain attributes a forward may branch on


def _walk(modules: Sequence[nn.Module]) -> List[nn.Module]:
    """Every submodule of `modules`, depth first, in order (a module shared by two parents is
    listed twice, the same way at every walk)."""
    subs, stack = [], list(reversed(modules))
    while stack:
        m = stack.pop()
        subs.append(m)
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return subs


class RunView:
    """The submodules of a run of modules, and the dicts that the graph checks read."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list(modules)
        self.module_ids = tuple(map(id, self.modules))
        self.subs = _walk(self.modules)
        self._own = [m.__dict__ for m in self.subs]  # each submodule's instance dict
        self._kids = self._all_children()

    def _all_children(self) -> tuple:
        return tuple(map(id, _chain(map(dict.values, map(_children, self._own)))))

    def current(self, modules: Sequence[nn.Module]) -> bool:
        """Whether `modules` and the tree below them are still the ones walked (every
        submodule's children, by identity)."""
        return tuple(map(id, modules)) == self.module_ids and self._all_children() == self._kids

    def fingerprint(self) -> tuple:
        """Every submodule's mode; each parameter's identity, tensor and requires_grad; each
        buffer's tensor (a view that is current)."""
        params = list(filter(_present, _chain(map(dict.values, map(_params, self._own)))))
        buffers = filter(_present, _chain(map(dict.values, map(_buffers, self._own))))
        return (tuple(map(_training, self.subs)), tuple(map(id, params)), tuple(map(_data_ptr, params)),
                tuple(map(_shape, params)), tuple(map(_requires_grad, params)), tuple(map(_data_ptr, buffers)))

    def hooked_or_checkpointed(self) -> bool:
        """Whether a submodule has a forward or backward hook, a parameter has a hook on its
        gradient (a graphed backward adds the gradients to buffers, not through the parameter's
        accumulation, so the hook would silently not run), or a submodule is marked for
        activation checkpointing (a view that is current)."""
        params = filter(_present, _chain(map(dict.values, map(_params, self._own))))
        return (any(_global_hooks(torch.nn.modules.module))
                or any(_chain(map(_hooks, self._own)))
                or any(_chain(map(_param_hooks, params)))
                or next(filter(_present, map(_checkpoint_mark, self._own)), None) is not None)

    def attributes(self) -> "AttributeSnapshot":
        """The submodules' plain attributes as they are now (taken when a capture is made)."""
        return AttributeSnapshot(self._own)


class AttributeSnapshot:
    """What a capture took as fixed besides parameters and buffers: the submodules' plain
    attributes. Tensors by identity, data pointer and shape (a cache kept as an attribute,
    rotary embeddings' cos/sin say, rebuilt for a longer sequence: the graph would read the
    old one's freed memory), and Python scalars by value (a Dropout's p, a schedule's rate:
    the graph took the value of the capture). `changed()` is what the graph check reads at
    each call: one itemgetter a submodule, in C, and a Python loop over the tensors only."""

    def __init__(self, own: List[dict]):
        self._getters, self._dicts = [], []
        self._tensors = []  # (instance dict, name, tensor, data pointer, shape)
        for d in own:
            # (`training` is the fingerprint's: a mode toggled for evaluation is no reason to
            # stop graphing a run, as repeated attribute changes are.)
            names = [k for k, v in d.items() if type(v) in _SCALARS and k != "training"]
            if names:
                self._getters.append(operator.itemgetter(*names))
                self._dicts.append(d)
            self._tensors += [(d, k, v, v.data_ptr(), v.shape) for k, v in d.items() if isinstance(v, torch.Tensor)]
        self._values = self._read()

    def _read(self):
        try:
            return tuple(map(operator.call, self._getters, self._dicts))
        except KeyError:  # an attribute was deleted
            return None

    def changed(self) -> str:
        """"" if every attribute is as it was; else the name of one that changed."""
        values = self._read()
        try:
            differ = values != self._values
        except Exception:  # a scalar replaced by a tensor, say: comparing raises
            return "an attribute (replaced by one of another kind)"
        # (A scalar replaced by a one-element tensor of the same value compares equal: the
        # graph's constant is then still the value eager would use.)
        if differ:
            try:  # (which one, for the log)
                for getter, was, now in zip(self._getters, self._values, values or [None] * len(self._getters)):
                    if was is not now and was != now:
                        return f"an attribute among {getter} (was {was!r}, now {now!r})"
            except Exception:
                pass
            return "an attribute"
        for d, name, t, ptr, shape in self._tensors:
            now = d.get(name)
            if now is not t or t.data_ptr() != ptr or t.shape != shape:
                return f"the tensor attribute '{name}'"
        return ""
