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


_frame = world.frame


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
    line = next(line for line in results[0].stdout.splitlines() if line.startswith("REFUSED="))
    refused = int(line.split()[0].split("=")[1])
    steps = int(line.split()[1].split("=")[1])
    assert stats["inputs"] > 100 and refused > 0 and steps > 10, (stats, line)
    print(f"store fuzz: {stats['inputs']} inputs, {refused} refused, {steps} healthy steps")


def _store_get(port: int, secret: bytes, key: bytes, deadline: float) -> bytes:
    """An authenticated GET, retried until the key exists (or the deadline passes)."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(_frame(secret))
                world.recv_frame(s)  # the welcome
                while time.monotonic() < deadline:
                    s.sendall(_frame(b"\x02" + _string(key)))
                    body = world.recv_frame(s)
                    if body[0] == 1:
                        (n,) = struct.unpack_from("<I", body, 1)
                        return body[5:5 + n]
                    time.sleep(0.02)
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"store key {key!r} never appeared")


def _bootstrap_input(rng: random.Random, port: int, secret: bytes, own_rank: int, held: list) -> None:
    """One hostile connection to a rank's listener for other hosts' ranks. With the secret,
    only handshakes that claim no real channel (a rank out of range, on the listener's own
    host, above it, or a bad channel kind): an attacker who knows the secret is a rank."""
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    kind = rng.randrange(9)
    if kind == 0:  # idle: holds a slot until the handshake deadline
        held.append(s)
        return
    try:
        if kind == 1:
            s.sendall(rng.randbytes(rng.randrange(1, 64)))
        elif kind == 2:
            s.sendall(struct.pack("<Q", rng.choice([4097, 1 << 20, 1 << 40, (1 << 64) - 1])) + rng.randbytes(8))
        elif kind == 3:
            s.sendall(_frame(_string(rng.randbytes(len(secret))) + struct.pack("<ii", 0, 0)))
        elif kind in (4, 5, 6):
            peer = {4: rng.choice([-1, 99, 1 << 30]), 5: own_rank, 6: 0}[kind]
            channel = rng.choice([-1, 3, 77]) if kind == 6 else 0
            s.sendall(_frame(_string(secret) + struct.pack("<ii", peer, channel)))
        elif kind == 7:  # a frame started and abandoned
            s.sendall(struct.pack("<Q", 40) + rng.randbytes(3))
            held.append(s)
            return
        # kind 8: connect and close at once
    except OSError:
        pass
    s.close()


def test_bootstrap_listener_fuzz_keeps_the_job_starting():
    """Two simulated hosts: ranks 2 and 3 listen for ranks 0 and 1. Before rank 1 starts (so
    before any real connection), and while the listeners wait, each gets a burst of idle
    connections, garbage, oversized length prefixes, wrong secrets and right-secret
    handshakes claiming no real channel. Every world still starts and computes correctly,
    and the listeners count what they refused. Repeated for SMDDP_TEST_FUZZ_SECONDS."""
    deadline_all = time.monotonic() + FUZZ_SECONDS
    worlds = inputs = refused = 0
    while worlds == 0 or time.monotonic() < deadline_all:
        port, secret = world.free_port(), uuid.uuid4().hex
        rng = random.Random(worlds)
        release, held, sent = threading.Event(), [], [0]

        def attack():
            try:
                deadline = time.monotonic() + 30
                ports = {r: int(_store_get(port, secret.encode(), f"rank/{r}".encode(), deadline).split(b"\n")[2])
                         for r in (2, 3)}
                for _ in range(120):
                    for r, p in ports.items():
                        try:
                            _bootstrap_input(rng, p, secret.encode(), r, held)
                            sent[0] += 1
                        except OSError:
                            pass
            finally:
                release.set()

        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        try:
            results = run_world(4, "healthy_for.py", ["0.5"], hosts=2, timeout=90, port=port, secret=secret,
                                held=[1], release=release)
        finally:
            release.set()
            attacker.join()
            for s in held:
                s.close()
        assert_all_ok(results)
        worlds += 1
        inputs += sent[0]
        refused += sum(int(r.stdout.split("BOOTSTRAP_REFUSED=")[1].split()[0]) for r in results[2:])
    assert inputs >= 200 and refused > 0, (worlds, inputs, refused)
    print(f"bootstrap fuzz: {worlds} worlds, {inputs} inputs, {refused} refused and logged")
