"""Two ranks that met dtypes in a different order still agree on a mixed-dtype reduction.

Rank 0 reduces a float64 tensor ("f64") before a float32 + float64 group ("mixed"); rank 1
reduces the group first. Both reductions are named, so the engine matches them in any
order, but each blocks its caller, so every rank issues its first one on a helper thread and
the second one on the main thread once the first has reached the engine (its shapes check
is submitted right after its dtypes were coded). The codes in that check must therefore not
depend on the order in which a process first met each dtype.

Prints "DTYPE HISTORY OK" when both reductions give the right values on this rank.
"""
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import smdistributed.dataparallel.tensorflow as sdp  # noqa: E402
from smdistributed.common import engine  # noqa: E402

sdp.init()
N, R = sdp.size(), sdp.rank()
assert N == 2, "this check needs exactly two ranks (one history each)"


def single():
    return sdp.allreduce(tf.constant(np.full(3, R + 1, np.float64)), op=sdp.Sum, name="f64")


def mixed():
    return sdp.grouped_allreduce([tf.constant(np.full(4, R + 1, np.float32)),
                                  tf.constant(np.full(2, 10 * (R + 1), np.float64))], op=sdp.Sum, name="mixed")


first, second = (single, mixed) if R == 0 else (mixed, single)
results, errors = {}, []


def run_first():
    try:
        results[first.__name__] = first()
    except Exception as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)


c = engine.get()
before = c.counters()["submitted"]
helper = threading.Thread(target=run_first)
helper.start()
deadline = time.monotonic() + 60
while c.counters()["submitted"] == before and not errors:
    assert time.monotonic() < deadline, "the first reduction never reached the engine"
    time.sleep(0.01)
try:
    results[second.__name__] = second()
finally:
    helper.join()
if errors:
    raise errors[0]

np.testing.assert_array_equal(results["single"].numpy(), np.full(3, 3.0))
got32, got64 = results["mixed"]
assert got32.dtype == tf.float32 and got64.dtype == tf.float64
np.testing.assert_array_equal(got32.numpy(), np.full(4, 3.0))
np.testing.assert_array_equal(got64.numpy(), np.full(2, 30.0))
sdp.shutdown()
print("DTYPE HISTORY OK", flush=True)
