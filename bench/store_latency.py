"""Latency of an authenticated rendezvous-store request while idle connections pile up.

    python bench/store_latency.py [--idle 0,100,500] [--requests 2000]

Starts a 2-rank job (tests/workers/healthy_for.py) whose rank 0 serves the store, then, from
this process, opens N idle TCP connections to the store (never presenting the secret) and
times GET requests on a connection authenticated before them (as a rank's is), and how long
a client arriving during the flood takes to connect, authenticate and get an answer (beyond
the cap it is turned away until the idle connections reach their deadline). The store reads every connection on one
poll() with a 2 s handshake deadline and at most 256 open connections (docs/core.md), so
idle ones must not slow the authenticated client. Prints a table and writes
bench/results/store_latency.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from world import WORKERS, frame, free_port, recv_frame  # noqa: E402


def connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def authenticate(port: int, secret: str, deadline_s: float = 30) -> socket.socket:
    """An authenticated connection; retried while the store turns connections away at its
    cap (it drops unauthenticated ones after its 2 s handshake deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            s = connect(port)
            s.sendall(frame(secret.encode()))
            assert recv_frame(s).startswith(b"smddp-store-ok")
            return s
        except (OSError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def time_gets(s: socket.socket, requests: int) -> list:
    key = b"rank/0"
    get = frame(b"\x02" + struct.pack("<I", len(key)) + key)
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        s.sendall(get)
        recv_frame(s)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", default="0,100,500")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--out", default=str(HERE / "results" / "store_latency.json"))
    args = ap.parse_args()
    port, secret = free_port(), uuid.uuid4().hex
    env = dict(os.environ, SMDDP_SIZE="2", SMDDP_LOCAL_SIZE="2", SMDDP_STORE_ADDR="127.0.0.1",
               SMDDP_STORE_PORT=str(port), SMDDP_SECRET=secret, CUDA_VISIBLE_DEVICES="", SMDDP_LOG_LEVEL="-1")
    ranks = [subprocess.Popen([sys.executable, str(WORKERS / "healthy_for.py"), "600"],
                              env=dict(env, SMDDP_RANK=str(r), SMDDP_LOCAL_RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
    rows = []
    try:
        time_gets(authenticate(port, secret), 50)  # the store is up, the job bootstrapped
        for n in [int(x) for x in args.idle.split(",")]:
            client = authenticate(port, secret)  # a rank's connection, made before the flood
            idle = []
            for _ in range(n):
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            times = sorted(time_gets(client, args.requests))
            t0 = time.perf_counter()
            late = authenticate(port, secret)  # a client arriving during the flood
            time_gets(late, 1)
            join_ms = (time.perf_counter() - t0) * 1e3
            rows.append({"idle_connections_opened": n, "median_us": statistics.median(times) * 1e6,
                         "p99_us": times[int(len(times) * 0.99) - 1] * 1e6, "requests": len(times),
                         "new_client_connect_auth_get_ms": join_ms})
            for c in [client, late, *idle]:
                c.close()
            time.sleep(2.5)  # the store drops what is left after its handshake deadline
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    print(f"{'idle connections':>18} {'median us':>10} {'p99 us':>10} {'new client ms':>14}")
    for r in rows:
        print(f"{r['idle_connections_opened']:>18} {r['median_us']:>10.1f} {r['p99_us']:>10.1f} "
              f"{r['new_client_connect_auth_get_ms']:>14.1f}")
    Path(args.out).write_text(json.dumps({
        "benchmark": "authenticated store GET latency with idle unauthenticated connections open",
        "command": "python bench/store_latency.py " + " ".join(sys.argv[1:]),
        "machine": {"nproc": os.cpu_count(), "processor": platform.machine()},
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
