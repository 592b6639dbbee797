"""The timed steps of pipeline_bench.py's first configuration, for tools that run it unchanged
(smp_host_probe.py, smp_yappi.py): the benchmark resets the GPU's peak-memory counters before
each configuration and again after its warm-up, so the timed steps run from the second reset
to the third."""
from typing import Callable

import torch


def on_timed_steps(start: Callable[[], None], stop: Callable[[], None]) -> None:
    """Calls `start` when the first configuration's timed steps begin and `stop` when they end."""
    resets = [0]
    reset = torch.cuda.reset_peak_memory_stats

    def counted_reset(*args, **kwargs):
        resets[0] += 1
        if resets[0] == 2:
            start()
        elif resets[0] == 3:
            stop()
        return reset(*args, **kwargs)
    torch.cuda.reset_peak_memory_stats = counted_reset
