"""One traced forward of the whole model, for the automatic partition.

Records, per module path: the order modules are first called in, the bytes of parameters
and buffers its subtree holds plus the bytes its outputs take (memory), and either measured
time (trace_execution_times) or a work estimate, parameters plus output elements (compute).
With trace_memory_usage the forward runs with gradients on and the memory also counts the
bytes its subtree saves for the backward (the activations a pipeline stage holds per
microbatch), seen through autograd's saved-tensor hooks, so on any device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn as nn

from .nested import is_mapping


@dataclass
class Trace:
    order: List[str] = field(default_factory=list)
    compute: Dict[str, float] = field(default_factory=dict)
    memory: Dict[str, float] = field(default_factory=dict)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    if is_mapping(obj):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


class Tracer:
    def __init__(self, root: nn.Module, timed: bool, measure_saved: bool = False):
        """`measure_saved`: count what autograd saves for the backward (the caller runs the
        forward with gradients on)."""
        self.root = root
        self.timed = timed
        self._saved: Dict[str, int] = {}
        self._seen: set = set()  # (path, storage) pairs already counted
        self._stack: List[str] = []  # modules being called, innermost last
        self._saved_hooks = None
        if measure_saved:
            self._params = {t.data_ptr() for t in [*root.parameters(), *root.buffers()]}
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.trace = Trace()
        self._paths = {id(m): p for p, m in root.named_modules()}
        self._out_bytes: Dict[str, int] = {}
        self._time: Dict[str, float] = {}
        self._start: Dict[int, List[float]] = {}
        self._handles = []

    def __enter__(self):
        for m in self.root.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        if self._saved_hooks is not None:
            self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._finish()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor saved for the backward: counted once for the innermost module being called,
        unless it is a parameter or buffer (held already) or shares storage with one counted."""
        if self._stack and t.data_ptr() not in self._params:
            key = (self._stack[-1], t.untyped_storage().data_ptr())
            if key not in self._seen:
                self._seen.add(key)
                self._saved[self._stack[-1]] = self._saved.get(self._stack[-1], 0) + \
                    t.untyped_storage().nbytes()
        return t

    def _sync(self):
        if self.timed and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _pre(self, m, args):
        path = self._paths.get(id(m))
        if path is None:
            return
        if path not in self._out_bytes:
            self.trace.order.append(path)
            self._out_bytes[path] = 0
        self._stack.append(path)
        if self.timed:
            self._sync()
            self._start.setdefault(id(m), []).append(time.perf_counter())

    def _post(self, m, args, out):
        path = self._paths.get(id(m))
        if path is None:
            return
        self._out_bytes[path] += _tensor_bytes(out)
        if self._stack and self._stack[-1] == path:
            self._stack.pop()
        if self.timed:
            self._sync()
            t0 = self._start[id(m)].pop()
            self._time[path] = self._time.get(path, 0.0) + time.perf_counter() - t0

    def _finish(self):
        for path, m in self.root.named_modules():
            held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
            out = self._out_bytes.get(path, 0)
            inside = [f"{path}.{q}" if path else q for q, _ in m.named_modules() if q]  # its submodules
            saved = sum(self._saved.get(p, 0) for p in [path, *inside])
            self.trace.memory[path] = float(held + out + saved)
            if self.timed:
                self.trace.compute[path] = self._time.get(path, 0.0)
            else:
                elems = sum(p.numel() for p in m.parameters()) + out / 4
                # Children's outputs are work done inside this module too.
                inner = sum(self._out_bytes.get(p, 0) for p in inside) / 4
                self.trace.compute[path] = float(elems + inner)
