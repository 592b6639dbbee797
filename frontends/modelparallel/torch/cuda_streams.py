"""torch.cuda's stream calls in the forms that cost the host least, for the per-message and
per-replay paths of the pipeline.

`torch.cuda.current_stream()` without a device, and `torch.cuda.stream(s)` (which asks for the
current stream three times that way), look up the thread's current device through a chain of
Python calls each time. On the last stage of the graphed pipeline benchmark these ran about
eight and three times a microbatch (2 x H200, m = 16, session 31). Every pipeline thread runs on
the rank's one device (workers.py sets it), so the callers here name it by index instead.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def current(index: int) -> torch.cuda.Stream:
    """The calling thread's current stream on device `index`."""
    return torch.cuda.current_stream(index)


@contextmanager
def running_on(stream: torch.cuda.Stream):
    """Makes `stream` the current stream of its device until the block ends, as
    `torch.cuda.stream(stream)` does, for a stream on the thread's current device only:
    `torch.cuda.set_stream` also makes the stream's device current, and this does not switch
    it back (every caller's stream is on the rank's one device, its threads' current one)."""
    before = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(before)
