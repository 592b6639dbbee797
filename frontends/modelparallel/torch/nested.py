"""Nested inputs and outputs (lists, tuples, named tuples, mappings) rebuilt in their own types."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Iterable, Tuple


def is_mapping(value: Any) -> bool:
    """dict, OrderedDict, and mappings that are not dicts: Hugging Face's BatchEncoding (what its
    padding collators return) is a UserDict."""
    return isinstance(value, Mapping)


def mapping_like(value: Mapping, pairs: Iterable[Tuple[Any, Any]]) -> Mapping:
    """A mapping of value's type holding `pairs`. A dict subclass (OrderedDict, transformers'
    ModelOutput) is built from the pairs; another mapping (a BatchEncoding, whose constructor
    takes more than pairs) is a copy of value with its items replaced, so that its other
    attributes stay; a plain dict when neither works."""
    pairs = list(pairs)
    try:
        if isinstance(value, dict):
            return type(value)(pairs)
        out = copy.copy(value)
        for key in list(out.keys()):
            del out[key]
        for key, item in pairs:
            out[key] = item
        return out
    except Exception:  # a mapping that refuses to be rebuilt or written
        return dict(pairs)
