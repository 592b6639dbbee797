"""cuBLAS and cuBLASLt workspaces: torch keeps one of each (32 MiB each on Hopper) for every
thread that multiplied matrices on a stream, for as long as the process lives.

A pipeline stage computes on several threads (a microbatch's step function, the runners that
serve peers, the autograd engine's device thread), one at a time under the compute token, so
keeping every thread's workspaces holds 64 MiB per thread at the stage's peak where torch's
1F1B, on one thread, holds them for one (measured on 4 x H200 at pp=4 with 4 active
microbatches: a first-stage peak 0.13-0.14 GB above 1F1B's at every m;
bench/results/session21_h200x4_2026-11-27.md). Freeing them when a thread gives the token
back leaves only the computing thread's: the next thread's first product allocates new ones,
from the blocks just freed. Every stage computes on the device's default stream, so a freed
workspace that a queued kernel still uses is only reused by work queued after it (the
caching allocator's stream order), as when torch frees them itself before a graph capture.

torch's call frees every thread's workspaces, not only smp's: a thread outside smp that runs a
matrix product on the default stream during smp.step could lose its workspace between setting
it and launching the product. SMDDP_SMP_FREE_BLAS_WORKSPACES=0 keeps them for such programs.
"""
from __future__ import annotations

import torch


def free_blas_workspaces() -> None:
    """Drops torch's cuBLAS and cuBLASLt workspaces of every thread (stream ordered; a thread
    that multiplies matrices later gets new ones)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
