"""Starts a world of real rank processes for a test and collects each rank's outcome.

Ranks are started directly (not through smddprun) so a test can see every rank's exit
status and output even when one of them dies on purpose. Each run has a hard timeout
that only guards against hangs; no test asserts how fast anything is.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from smdistributed.common.ports import free_listen_ports

WORKERS = Path(__file__).parent / "workers"
HANG_GUARD_S = 180


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    # What the worker reported through tests/workers/report.py, in order.
    reports: List[dict] = field(default_factory=list)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def events(self, event: str) -> List[dict]:
        """Every report of this kind, in the order the rank made them."""
        return [r for r in self.reports if r["event"] == event]

    def event(self, event: str) -> dict:
        """The one report of this kind (an assertion error naming the rank's output if not)."""
        found = self.events(event)
        assert len(found) == 1, f"rank {self.rank}: {len(found)} '{event}' reports\n{self.output}"
        return found[0]


def read_reports(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reports_in_stdout(stdout: str) -> List[dict]:
    """Reports of a worker started without SMDDP_TEST_REPORT (report.py prints them)."""
    return [json.loads(line[len("REPORT "):]) for line in stdout.splitlines() if line.startswith("REPORT ")]


def frame(payload: bytes) -> bytes:
    """A frame of the store and bootstrap protocols: u64 length, then the payload."""
    return struct.pack("<Q", len(payload)) + payload


def recv_frame(s: socket.socket) -> bytes:
    """One frame from a store connection; ConnectionResetError if it closes first."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = s.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError("the store closed the connection")
            data += chunk
        return data
    (n,) = struct.unpack("<Q", exactly(8))
    return exactly(n)


def free_port() -> int:
    """A port for a world's store, outside the ephemeral range (smdistributed.common.ports:
    a port bind(0) picks can be taken by another socket before rank 0 listens on it)."""
    return free_listen_ports(1)[0]


def run_world(
    nranks: int,
    worker: str,
    args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    per_rank_env: Optional[Dict[int, Dict[str, str]]] = None,
    hosts: int = 1,
    timeout: float = HANG_GUARD_S,
    gpus: bool = False,
    kill_after_others: Sequence[int] = (),
    port: Optional[int] = None,
    secret: Optional[str] = None,
    held: Sequence[int] = (),
    release=None,
) -> List[RankResult]:
    """Runs tests/workers/<worker> as `nranks` ranks split over `hosts` simulated hosts.
    With `gpus`, the ranks see the machine's GPUs and the workers run on them
    (SMDDP_TEST_DEVICE=cuda, one GPU per rank). Ranks in `kill_after_others` (one that stops
    itself, say) are killed once every other rank has exited. `port` and `secret`: the store's
    (default: a free port, a random secret), for tests that talk to the store themselves.
    Ranks in `held` start only once the event `release` is set (or after the timeout), so a
    test can act on the others' bootstrap first."""
    port = port or free_port()
    secret = secret or uuid.uuid4().hex
    report_dir = Path(tempfile.mkdtemp(prefix="smddp-reports-"))
    per_host = (nranks + hosts - 1) // hosts
    procs: Dict[int, subprocess.Popen] = {}
    launch_order = [r for r in range(nranks) if r not in held] + list(held)
    for rank in launch_order:
        if rank in held and release is not None and not release.is_set():
            release.wait(timeout)
        host = rank // per_host
        local_size = min(per_host, nranks - host * per_host)
        e = dict(os.environ)
        e.update(
            SMDDP_RANK=str(rank), SMDDP_SIZE=str(nranks), SMDDP_LOCAL_RANK=str(rank - host * per_host),
            SMDDP_LOCAL_SIZE=str(local_size), SMDDP_STORE_ADDR="127.0.0.1", SMDDP_STORE_PORT=str(port),
            SMDDP_SECRET=secret, SMDDP_HOST=f"simhost{host}" if hosts > 1 else "", PYTHONUNBUFFERED="1",
            SMDDP_TEST_REPORT=str(report_dir / f"rank{rank}.jsonl"),
            PYTHONFAULTHANDLER="1",  # a hung rank's stacks, on the timeout's SIGABRT
        )
        e.setdefault("SMDDP_TIMEOUT", "20")
        if not e["SMDDP_HOST"]:
            del e["SMDDP_HOST"]
        if gpus:
            e["SMDDP_TEST_DEVICE"] = "cuda"
            e.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
        else:
            # These worlds test the CPU path; a GPU on the machine must not pull tensors onto it.
            e["CUDA_VISIBLE_DEVICES"] = ""
        e.update(env or {})
        e.update((per_rank_env or {}).get(rank, {}))
        procs[rank] = subprocess.Popen([sys.executable, str(WORKERS / worker), *args], env=e,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    try:
        order = [r for r in range(nranks) if r not in kill_after_others] + list(kill_after_others)
        for rank in order:
            p = procs[rank]
            if rank in kill_after_others and p.poll() is None:
                p.kill()
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                exited = _ranks_that_exited(procs, results)  # before the live ones are stopped
                raise AssertionError(f"{worker} on {nranks} ranks: rank {rank} still running after {timeout} s; "
                                     f"the live ranks' Python stacks:\n{_stacks_of_live(procs)}{exited}") from None
            results[rank] = RankResult(rank, p.returncode, out, err, read_reports(report_dir / f"rank{rank}.jsonl"))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(report_dir, ignore_errors=True)
    return [results[r] for r in range(nranks)]


def _stacks_of_live(procs: Dict[int, subprocess.Popen]) -> str:
    """Makes every rank still running print its threads' Python stacks (faulthandler, on
    SIGABRT) and returns the end of each one's stderr: where a hung world waits."""
    live = {rank: p for rank, p in procs.items() if p.poll() is None}
    for p in live.values():
        p.send_signal(signal.SIGABRT)
    dumps = []
    for rank, p in live.items():
        try:
            _, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            err = "(no stack: it did not stop on SIGABRT)"
        dumps.append(f"--- rank {rank}\n{(err or '')[-6000:]}")
    return "\n".join(dumps)


def _ranks_that_exited(procs: Dict[int, subprocess.Popen], results: Dict[int, RankResult]) -> str:
    """How each rank that had already exited ended: a world often hangs because one rank died
    early (at start-up, say) and the others wait for it."""
    lines = []
    for rank, p in sorted(procs.items()):
        if rank in results:
            r = results[rank]
            lines.append(f"--- rank {rank} exited {r.returncode}\n{r.output[-4000:]}")
        elif p.poll() is not None:
            try:
                out, err = p.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a child of the rank holds its pipes
                out, err = "", "(its output is held open by a child process)"
            lines.append(f"--- rank {rank} exited {p.returncode}\n{((out or '') + (err or ''))[-4000:]}")
    return ("\nRanks that had exited before:\n" + "\n".join(lines)) if lines else ""


def assert_all_ok(results: List[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exited {r.returncode}\n{r.output}" for r in bad)
