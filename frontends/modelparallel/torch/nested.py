"""Nested inputs and outputs (lists, tuples, named tuples, mappings) rebuilt in their own types."""
from __future__ import annotations

import copy
from collections import UserDict, defaultdict
from collections.abc import Mapping
from typing import Any, Iterable, Tuple


def is_mapping(value: Any) -> bool:
    """dict, OrderedDict, and mappings that are not dicts: Hugging Face's BatchEncoding (what its
    padding collators return) is a UserDict."""
    return isinstance(value, Mapping)


def mapping_like(value: Mapping, pairs: Iterable[Tuple[Any, Any]]) -> Mapping:
    """A mapping of value's type holding `pairs`, value itself untouched:
    - a UserDict (BatchEncoding is one) is copied, which copies its items' dict and keeps its
      other attributes (a BatchEncoding's encodings), and the copy refilled;
    - a defaultdict keeps its default factory;
    - any other mapping is built from the pairs, or becomes a plain dict when its type cannot be."""
    pairs = list(pairs)
    try:
        if isinstance(value, UserDict):
            out = copy.copy(value)
            out.data = dict(pairs)
            return out
        if isinstance(value, defaultdict):
            return type(value)(value.default_factory, pairs)
        return type(value)(pairs)
    except Exception:  # a mapping type that cannot be built from pairs
        return dict(pairs)
