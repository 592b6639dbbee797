"""Names of collectives, the same on every rank (ranks match operations by name)."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import tensorflow as tf

from .runtime import core

# Ranks match operations by name. Eagerly, an unnamed operation takes the next number of a
# per-kind call counter (ranks run the same code, so the n-th call is the same operation on
# every rank). In a graph, the name is fixed when the op is traced: the outermost function's
# name plus a counter of the collectives traced into that function so far. Retracing a
# function starts its counter again, so names do not depend on how often a rank traced, and
# the ops of one function run in program order (TensorFlow chains stateful ops), so a name
# is never in flight twice.

_graph_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_graph_lock = threading.Lock()


try:
    from tensorflow.python.framework.func_graph import FuncGraph as _FuncGraph
except ImportError:  # pragma: no cover
    _FuncGraph = None


def _is_func_graph(graph) -> bool:
    if _FuncGraph is not None:
        return isinstance(graph, _FuncGraph)
    return type(graph).__name__ == "FuncGraph"


def _outermost_graph(graph):
    while _is_func_graph(graph):
        outer = getattr(graph, "outer_graph", None)
        if outer is None or not _is_func_graph(outer):
            return graph
        graph = outer
    return graph


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in s)


def op_name(kind: str, name: Optional[str] = None) -> str:
    """A name for a collective that is the same on every rank (see above)."""
    if name is not None:
        return f"tf.{kind}.{name}"
    if tf.executing_eagerly():
        return core()._auto_name(f"tf.{kind}", None)
    graph = tf.compat.v1.get_default_graph()
    top = _outermost_graph(graph)
    with _graph_lock:
        n = _graph_counters.get(top, 0)
        _graph_counters[top] = n + 1
    label = _safe(getattr(top, "name", "") or "graph") if _is_func_graph(top) else "graph"
    return f"tf.{kind}.{label}.{n}"
