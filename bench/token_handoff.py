"""How long smp's compute token takes to pass from one task to the next, with K other tasks
waiting behind them (the pipeline runtime has one thread per microbatch and per served call;
most of them wait for the token most of the time).

    python bench/token_handoff.py [--rounds 300]

Prints the median and the largest hand-off, in microseconds, for each K. No framework work:
this is the scheduler's own cost, which every hand-off of a pipeline step pays.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from smdistributed.modelparallel.torch.scheduler import ComputeToken


def handoffs(waiting: int, rounds: int) -> list[float]:
    token = ComputeToken(lambda: None)
    token.acquire((0, -1))
    idle = [threading.Thread(target=lambda i=i: (token.acquire((1000 + i, 0)), token.release()))
            for i in range(waiting)]
    for t in idle:
        t.start()
    queued, got, done = threading.Event(), threading.Event(), threading.Event()
    latencies: list[float] = []
    released_at = [0.0]

    def taker():
        for r in range(rounds):
            queued.set()
            token.acquire((1, r))
            latencies.append(time.perf_counter() - released_at[0])
            got.set()
            done.wait()  # the main thread has queued for the token again
            done.clear()
            token.release()

    t = threading.Thread(target=taker)
    t.start()
    for _ in range(rounds):
        queued.wait()
        queued.clear()
        time.sleep(0.001)  # the taker is asleep in acquire
        released_at[0] = time.perf_counter()
        token.release()
        got.wait()
        got.clear()
        threading.Timer(0.001, done.set).start()
        token.acquire((0, 0))  # ahead of the idle waiters
    t.join()
    token.release()
    for w in idle:
        w.join()
    return latencies


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    for k in (0, 4, 16, 32):
        lat = handoffs(k, args.rounds)
        print(f"{k:>3} other tasks waiting: hand-off median {statistics.median(lat) * 1e6:7.1f} us, "
              f"largest {max(lat) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
