"""A bounded fuzzer against the rendezvous store of a running job: random bytes, random and
huge length prefixes, half-sent frames, and, with the right secret, malformed and random
requests. The job keeps computing correctly throughout, the store process does not crash,
and the rejections are counted."""
import os
import random
import socket
import struct
import threading
import time
import uuid

from world import assert_all_ok, run_world
import world

FUZZ_SECONDS = float(os.environ.get("SMDDP_TEST_FUZZ_SECONDS", "8"))
FUZZ_THREADS = int(os.environ.get("SMDDP_TEST_FUZZ_THREADS", "2"))


def _frame(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


def _string(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _one_input(rng: random.Random, port: int, secret: bytes) -> None:
    kind = rng.randrange(6)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.settimeout(0.2)
        if kind == 0:  # raw garbage
            s.sendall(rng.randbytes(rng.randrange(0, 64)))
        elif kind == 1:  # a length prefix of any size, a little payload
            s.sendall(struct.pack("<Q", rng.choice([0, 1, 7, 4096, 4097, 1 << 20, 1 << 40, (1 << 64) - 1]))
                      + rng.randbytes(rng.randrange(0, 32)))
        elif kind == 2:  # a wrong secret of the right shape
            s.sendall(_frame(rng.randbytes(len(secret))))
        else:  # authenticated, then a malformed or random request
            s.sendall(_frame(secret))
            try:
                s.recv(64)
            except socket.timeout:
                pass
            if kind == 3:
                s.sendall(_frame(rng.randbytes(rng.randrange(0, 48))))
            elif kind == 4:  # a set/get with lengths that lie
                body = bytes([rng.choice([1, 2, 3, 255])]) + struct.pack("<I", rng.choice([0, 5, 1 << 31])) + b"fuzz"
                s.sendall(_frame(body))
            else:  # a well-formed request of a key of our own
                key = b"fuzz/" + str(rng.randrange(100)).encode()
                if rng.random() < 0.5:
                    s.sendall(_frame(b"\x01" + _string(key) + _string(rng.randbytes(rng.randrange(64)))))
                else:
                    s.sendall(_frame(b"\x02" + _string(key)))
        try:
            s.recv(64)
        except (socket.timeout, OSError):
            pass


def test_store_fuzz_keeps_the_job_healthy():
    port, secret = world.free_port(), uuid.uuid4().hex
    stats = {"inputs": 0}
    stop = threading.Event()

    lock = threading.Lock()

    def fuzz(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                _one_input(rng, port, secret.encode())
                with lock:
                    stats["inputs"] += 1
            except OSError:
                time.sleep(0.01)  # the store is not up yet, or just closed the connection

    fuzzers = [threading.Thread(target=fuzz, args=(1234 + i,), daemon=True) for i in range(FUZZ_THREADS)]
    for f in fuzzers:
        f.start()
    try:
        results = run_world(2, "healthy_for.py", [str(FUZZ_SECONDS)], timeout=FUZZ_SECONDS + 90, port=port,
                            secret=secret)
    finally:
        stop.set()
        for f in fuzzers:
            f.join()
    assert_all_ok(results)
    line = next(l for l in results[0].stdout.splitlines() if l.startswith("REFUSED="))
    refused = int(line.split()[0].split("=")[1])
    steps = int(line.split()[1].split("=")[1])
    assert stats["inputs"] > 100 and refused > 0 and steps > 10, (stats, line)
    print(f"store fuzz: {stats['inputs']} inputs, {refused} refused, {steps} healthy steps")
