"""Bad input and failures: every rank raises a clear error, nothing hangs, nothing leaks."""
import json
import os
from pathlib import Path

import pytest

from world import assert_all_ok, run_world

FAST_TIMEOUT = {"SMDDP_TIMEOUT": "4"}


def raised(result):
    return [e["message"] for e in result.events("raised")]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("shape", ["disagree on the shape of tensor 'w.shape'", "rank 0 has [4]", "rank 1 has [5]"]),
        ("dtype", ["disagree on the dtype of tensor 'w.dtype'", "rank 0 has float32", "rank 1 has float64"]),
        ("op", ["disagree on the reduce op of tensor 'w.op'", "rank 0 has SUM", "rank 1 has MAX"]),
        ("root", ["disagree on the root of tensor 'w.root'", "rank 0 has 0", "rank 1 has 1"]),
    ],
)
@pytest.mark.parametrize("warm", [pytest.param(False, id="cold"), pytest.param(True, id="cached")])
@pytest.mark.parametrize("nranks", [2, 3])
def test_mismatch_raises_on_every_rank(case, expected, nranks, warm):
    """Cold: every rank announces in full. Cached: the collective ran twice before, so the
    ranks that keep its arguments list it in a hit cycle while the others announce it in
    full; the coordinator takes the listings over and names the difference at once (well
    inside the 4 s timeout, which would name a missing rank instead)."""
    results = run_world(nranks, "errors.py", [("warm_" if warm else "") + case], env=FAST_TIMEOUT)
    assert_all_ok(results)
    for r in results:
        msgs = raised(r)
        assert len(msgs) == 1, r.output
        for fragment in expected:
            assert fragment in msgs[0], (fragment, msgs[0])
        r.event("usable")


def test_duplicate_name_in_flight(tmp_path):
    results = run_world(2, "errors.py", ["duplicate"], env=dict(FAST_TIMEOUT, SYNC_DIR=str(tmp_path)))
    assert_all_ok(results)
    assert "submitted again before its previous allreduce completed" in raised(results[0])[0]
    for r in results:
        r.event("usable")


@pytest.mark.parametrize("warm", [pytest.param(False, id="cold"), pytest.param(True, id="cached")])
def test_missing_rank_times_out_naming_it(tmp_path, warm):
    case = "warm_missing" if warm else "missing"
    results = run_world(3, "errors.py", [case], env=dict(FAST_TIMEOUT, SYNC_DIR=str(tmp_path)))
    assert_all_ok(results)
    for r in results[:2]:
        msg = raised(r)[0]
        assert "tensor 'lonely' was submitted by rank(s) 0, 1 but rank(s) 2 did not submit it" in msg, msg


def test_bad_root_is_refused_locally():
    results = run_world(2, "errors.py", ["bad_root"], env=FAST_TIMEOUT)
    assert_all_ok(results)
    for r in results:
        assert "root 5 is not a rank of this world of 2" in raised(r)[0]


@pytest.mark.parametrize("mode", ["before", "during"])
@pytest.mark.parametrize("hosts", [1, 2])
@pytest.mark.parametrize("victim", ["last", "rank0"])
def test_dead_peer_is_named(mode, hosts, victim):
    """A rank SIGKILLed before or during a large allreduce, the coordinator or not, on one
    host or two: every survivor raises naming it (the rank that sees the death first tells
    every other rank, not only rank 0), and later calls fail at once."""
    n = 3 if hosts == 1 else 4
    dead = n - 1 if victim == "last" else 0
    results = run_world(n, "dead_peer.py", [mode, str(dead)], env=FAST_TIMEOUT, hosts=hosts)
    assert results[dead].returncode == -9, results[dead].output
    for r in results:
        if r.rank == dead:
            continue
        assert r.returncode == 0, r.output
        names_victim = (f"rank {dead} ", f"rank(s) {dead} ")
        msg = raised(r)[0]
        assert any(n in msg for n in names_victim), msg
        again = r.event("again")["message"]  # a later call fails at once, with the same cause
        assert any(n in again for n in names_victim), again


def test_wrong_secret_is_refused_and_logged():
    results = run_world(2, "wrong_secret.py")
    assert_all_ok(results)
    assert "INTRUDER_CLOSED=True" in results[1].stdout
    assert "REFUSED=1" in results[0].stdout
    assert "refused a connection" in results[0].stderr and "wrong or missing secret" in results[0].stderr


def test_rank_with_wrong_secret_cannot_join():
    results = run_world(2, "errors.py", ["shape"], env={"SMDDP_TIMEOUT": "3"},
                        per_rank_env={1: {"SMDDP_SECRET": "forged"}})
    assert results[1].returncode != 0
    assert "SMDDP_SECRET" in results[1].stderr
    assert results[0].returncode != 0  # rank 0 times out waiting for rank 1, with an error
    assert "timed out" in results[0].stderr and "rank/1" in results[0].stderr


def test_timeline_is_valid_chrome_trace(tmp_path):
    prefix = str(tmp_path / "trace")
    results = run_world(2, "timeline_run.py", env={"SMDDP_TIMELINE": prefix})
    assert_all_ok(results)
    for rank in range(2):
        events = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())
        names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert {"layer0.grad", "layer4.grad", "params"} <= names
        phases = {e["name"] for e in events if e.get("ph") == "X"}
        assert {"QUEUE", "NEGOTIATE", "BROADCAST"} <= phases, phases
        assert any(p.startswith("ALLREDUCE_") for p in phases), phases


def test_no_shared_memory_left_behind():
    """Runs last in this file: every world above (crashed ones included) cleaned up."""
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("smddp-")]
    assert leftovers == []


def test_staggered_exit_and_reinit_are_clean():
    """Ranks shutting down at different times (rank 0 first, then last), then starting a new
    engine, six times: every round works and no rank reports another as dead (a goodbye that
    failed for one peer used to skip the rest; a rank re-initialising could reach rank 0's
    previous store)."""
    results = run_world(4, "staggered_exit.py", ["6"])
    assert_all_ok(results)
    for r in results:
        assert "staggered exit ok" in r.stdout, r.output
        assert "died" not in r.output and "ERROR" not in r.output, r.output


def _flood(port, idle, done):
    """Idle connections, a 1 TiB length prefix, garbage and a slow client against the store."""
    import socket
    import struct
    import time as _time

    socks, deadline = [], _time.monotonic() + 20
    while not done.is_set() and _time.monotonic() < deadline and len(socks) < idle + 3:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            _time.sleep(0.05)
            continue
        n = len(socks)
        if n == idle:
            s.sendall(struct.pack("<Q", 1 << 40))  # would make a naive server allocate 1 TiB
        elif n == idle + 1:
            s.sendall(b"\x07" * 64)  # garbage
        elif n == idle + 2:
            s.sendall(struct.pack("<Q", 32) + b"x")  # starts a frame and goes quiet
        socks.append(s)
    done.wait(30)
    for s in socks:
        s.close()


def test_store_and_bootstrap_survive_a_flood():
    """Before any secret is checked, the store spends at most a handshake frame and two
    seconds on a connection, on one poll() for all of them: 40 idle connections, an oversized
    length prefix, garbage and a half-sent frame do not keep 3 ranks from starting, and every
    one is refused and counted."""
    import threading

    import world

    port = world.free_port()
    done = threading.Event()
    attacker = threading.Thread(target=_flood, args=(port, 40, done), daemon=True)
    try:
        attacker.start()
        results = run_world(3, "store_flood.py", ["43"], timeout=90, port=port)
    finally:
        done.set()
        attacker.join()
    assert_all_ok(results)
    refused = int(results[0].stdout.split("REFUSED=")[1].split()[0])
    assert refused >= 43, results[0].output
    assert "did not present the secret" in results[0].stderr and "more than the 4096 allowed" in results[0].stderr


def test_ranks_of_another_protocol_version_are_refused_clearly():
    """A rank from another release (its rendezvous record says protocol 1): rank 0 refuses to
    start, naming the rank and both versions, instead of misreading its messages later."""
    import os
    import socket
    import struct
    import subprocess
    import sys
    import time
    import uuid

    import world

    port, secret = world.free_port(), uuid.uuid4().hex
    env = dict(os.environ, SMDDP_RANK="0", SMDDP_SIZE="2", SMDDP_LOCAL_RANK="0", SMDDP_LOCAL_SIZE="1",
               SMDDP_HOST="hostA", SMDDP_STORE_ADDR="127.0.0.1", SMDDP_STORE_PORT=str(port), SMDDP_SECRET=secret,
               SMDDP_TIMEOUT="20", CUDA_VISIBLE_DEVICES="")
    rank0 = subprocess.Popen([sys.executable, "-c", "from smdistributed.common import engine; engine.init()"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def frame(payload: bytes) -> bytes:
        return struct.pack("<Q", len(payload)) + payload

    def string(b: bytes) -> bytes:
        return struct.pack("<I", len(b)) + b

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "rank 0's store never came up"
                time.sleep(0.05)
        with s:
            s.sendall(frame(secret.encode()))
            s.recv(64)  # the welcome
            record = b"hostB\n127.0.0.1\n1\n12345\n1\n"  # an older release's record: protocol 1
            s.sendall(frame(b"\x01" + string(b"rank/1") + string(record)))
            _, err = rank0.communicate(timeout=60)
    finally:
        if rank0.poll() is None:
            rank0.kill()
    assert rank0.returncode != 0
    assert "rank 1 runs smdistributed's wire protocol 1, this rank (0) protocol 5" in err, err
