"""A few named allreduces with the timeline on."""
import numpy as np

from smdistributed.common import engine

core = engine.init()
for step in range(2):
    works = [core.allreduce(np.ones(1000 * (i + 1), np.float32), name=f"layer{i}.grad", async_op=True)
             for i in range(5)]
    for w in works:
        w.wait()
core.broadcast(np.ones(10, np.float32), root=0, name="params")
engine.shutdown()
