"""Point-to-point latency on the smddp backend (CPU tensors), with and without a busy compute
thread beside the receiver, as a pipeline stage has:

    torchrun --nproc_per_node 2 bench/p2p_latency.py [--busy none|one|both] [--switch-interval S]

Rank 0 and rank 1 ping-pong a 4 KiB and a 64 KiB tensor (dist.send / dist.recv, 200 round
trips after 20 warm-up ones), then rank 0 streams 2000 of them to rank 1; rank 0 prints the
one-way latency and the time per streamed message. SMDDP_TORCH_BACKEND=python runs the Python
process group instead of the native Backend, for comparison. --busy starts a Python
thread doing small matmuls on rank 1 (one) or on both ranks (both).
"""
import argparse
import sys
import threading
import time

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

ap = argparse.ArgumentParser()
ap.add_argument("--busy", default="none", choices=["none", "one", "both"])
ap.add_argument("--switch-interval", type=float, default=None)
args = ap.parse_args()
if args.switch_interval is not None:
    sys.setswitchinterval(args.switch_interval)
dist.init_process_group("smddp")
rank = dist.get_rank()
stop = threading.Event()


def compute():  # holds the GIL between small torch ops, like a stage issuing its layers
    a = torch.randn(64, 64)
    while not stop.is_set():
        for _ in range(50):
            a = torch.tanh(a @ a)


if args.busy == "both" or (args.busy == "one" and rank == 1):
    threading.Thread(target=compute, daemon=True).start()
for size in (4096, 65536):
    t = torch.zeros(size // 4)

    def round_trip():
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)

    for _ in range(20):
        round_trip()
    t0 = time.perf_counter()
    for _ in range(200):
        round_trip()
    one_way = (time.perf_counter() - t0) / 400
    # Streaming: rank 0 sends 2000 messages back to back, rank 1 receives them (a stage's
    # stream of headers and activations): the time per message.
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(2000):
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
    per_message = (time.perf_counter() - t0) / 2000
    if rank == 0:
        print(f"busy {args.busy}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms, {size} B: "
              f"one-way {one_way * 1e6:.1f} us, streamed {per_message * 1e6:.1f} us/message", flush=True)
stop.set()
dist.destroy_process_group()
