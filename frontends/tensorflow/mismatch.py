"""The shapes check of a grouped reduction, and the error that says what differs.

Packed into buckets, tensors reach the engine as flat bytes, which hides their shapes from
the engine's own argument check. So every grouped reduction also reduces a small signature
of its tensors (count, dtypes, shapes), and a difference becomes an error on every rank
that names the tensor and the field.
"""
from __future__ import annotations

import numpy as np

from smdistributed.common.engine import core_dtype

from .runtime import SmddpError


def signature(arrays):
    """What every rank's tensors of one call must agree on (count, dtypes, shapes) as int64s
    x and -x: their MAX over ranks equals x on every rank exactly when all ranks agree, so a
    disagreement is seen by every rank. Returns the signature and a buffer for the result."""
    parts = [len(arrays)]
    for a in arrays:
        # The core's DType number: the same on every rank, whatever order each process met
        # dtypes in (numbering them by first meeting made ranks with different histories
        # disagree about the same tensors).
        parts += [int(core_dtype(a)), a.ndim, *a.shape]
    x = np.array(parts, np.int64)
    return np.concatenate([x, -x]), np.empty(2 * len(x), np.int64)


def mismatch_error(c, base, arrays, sig, sig_out, error):
    """The error for a failed shapes check: the engine's `error` if it raised, otherwise the
    first field where this rank's `sig` differs from the ranks' MAX `sig_out`."""
    shapes = ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in arrays[:16]) + (" ..." if len(arrays) > 16 else "")
    if error is not None:
        return SmddpError(f"{error} [in '{base}': {len(arrays)} dense tensors, packed by dtype; shapes on rank "
                          f"{c.rank}: {shapes}]")
    n = len(sig) // 2
    pos = int(np.flatnonzero((sig_out[:n] != sig[:n]) | (sig_out[n:] != sig[n:]))[0])
    lo, hi = -int(sig_out[n + pos]), int(sig_out[pos])
    what, p = f"the number of tensors ({len(arrays)} here, {lo}..{hi} over ranks)", 1
    for i, a in enumerate(arrays):
        fields = ["dtype", "rank"] + [f"dimension {d}" for d in range(a.ndim)]
        if p <= pos < p + len(fields):
            field = fields[pos - p]
            here = a.dtype.name if field == "dtype" else int(sig[pos])
            span = "differs between ranks" if field == "dtype" else f"is {here} here, {lo}..{hi} over ranks"
            what = f"tensor {i} ({a.dtype.name}{list(a.shape)} here): its {field} {span}"
            break
        p += len(fields)
    return SmddpError(f"'{base}': the ranks' tensors do not match: {what}. Shapes on rank {c.rank}: {shapes}")
