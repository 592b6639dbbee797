"""smddprun: start the ranks of a job.

On one host it starts the processes itself and supervises them: their output is
prefixed with the rank, SIGINT/SIGTERM reach all of them, and the first rank that
fails takes the others down with it. Across hosts it hands over to Open MPI's
mpirun, or, without one, says how to do the same with srun or torchrun.

The variables it sets are the ones `smdistributed.common.discovery` reads first.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from smdistributed.common.ports import HIGHEST as PORTS_HIGHEST, LOWEST as PORTS_LOWEST, free_listen_ports

PROG = "smddprun"
_GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping ranks
_POLL_S = 0.05
_DRAIN_S = 5.0  # how long output of exited ranks may keep arriving (their children may hold the pipes)
_FORWARDED = (signal.SIGINT, signal.SIGTERM)

_USAGE_NOTES = """\
One host:
  smddprun -np 4 python train.py
  Each rank gets SMDDP_RANK, SMDDP_SIZE, SMDDP_LOCAL_RANK, SMDDP_LOCAL_SIZE,
  SMDDP_STORE_ADDR, SMDDP_STORE_PORT, SMDDP_SECRET, and for torch scripts RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and the original
  library's SMDATAPARALLEL_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE, _SERVER_ADDR, _SERVER_PORT.

Several hosts (rank 0 and the rendezvous store run on the first host):
  smddprun -np 8 -H node1:4,node2:4 python train.py
  runs, when Open MPI's mpirun is on PATH:
  mpirun -np 8 -H node1:4,node2:4 -x SMDDP_SECRET -x SMDDP_STORE_ADDR ... python train.py
  Equivalents without mpirun (set SMDDP_SECRET to one random value everywhere):
  MASTER_ADDR=node1 MASTER_PORT=29500 srun --nodes=2 --ntasks=8 --ntasks-per-node=4 python train.py
  torchrun --nnodes 2 --node_rank <0 or 1> --nproc_per_node 4 \\
           --master_addr node1 --master_port 29500 train.py     (on each host)
"""


# ----------------------------------------------------------------------------- arguments

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, add_help=False, allow_abbrev=False,
        usage=f"{PROG} -np N [-H host1:slots,host2:slots] [options] [--] command ...")
    p.add_argument("-np", "--np", "-n", dest="np", type=int, metavar="N",
                   help="number of ranks (default with -H: all slots)")
    p.add_argument("-H", "--hosts", metavar="HOSTS",
                   help="comma-separated host[:slots] list (slots default to 1)")
    p.add_argument("--simulate-hosts", type=int, metavar="K",
                   help="on this host, split the ranks into K contiguous groups that "
                        "pose as hosts (SMDDP_HOST=simhost<i>), for tests")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run, start nothing")
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs")
    return p


def _config_lines() -> list[str]:
    # The table comes from the native core; without a built core (or without the
    # config module) the rest of the help is still worth printing.
    try:
        config = importlib.import_module("smdistributed.common.config")
        rows = [(str(n), str(d), str(m)) for n, d, m in config.config_table()]
    except ImportError as e:
        return [f"(configuration table unavailable: {e})"]
    if not rows:
        return ["(no configuration variables)"]
    w_name = max(len(r[0]) for r in rows + [("name", "", "")])
    w_def = max(len(r[1]) for r in rows + [("", "default", "")])
    lines = [f"{'name':<{w_name}}  {'default':<{w_def}}  meaning"]
    lines += [f"{n:<{w_name}}  {d:<{w_def}}  {m}" for n, d, m in rows]
    return lines


def _print_help(parser: argparse.ArgumentParser) -> None:
    out = [parser.format_help(), _USAGE_NOTES, "Configuration (environment variables):"]
    out += ["  " + line for line in _config_lines()]
    print("\n".join(out))


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- hosts

def _parse_hosts(spec: str) -> list[tuple[str, int]]:
    hosts = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        # "[v6addr]:slots", "name:slots", or a bare name or address (one slot).
        m = re.fullmatch(r"\[(.+)\]:(\d+)|([^:]+):(\d+)|\[?([^\]]+)\]?", part)
        if not m:
            raise ValueError(f"bad host entry {part!r}")
        name = m.group(1) or m.group(3) or m.group(5)
        slots = int(m.group(2) or m.group(4) or 1)
        if slots < 1:
            raise ValueError(f"host entry {part!r} has no slots")
        hosts.append((name, slots))
    if not hosts:
        raise ValueError("-H names no hosts")
    return hosts


def _is_this_host(name: str) -> bool:
    if name.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        # Another address of this machine is not recognised; mpirun copes with it.
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    # Compare short names too: "node1.cluster" is this host when it calls itself "node1".
    mine = socket.gethostname().lower()
    return name.lower() in (mine, mine.split(".")[0]) or name.lower().split(".")[0] == mine


def _layout(hosts: list[tuple[str, int]], np: int) -> list[tuple[str, int]]:
    """Ranks per host, filling hosts in order as mpirun's default by-slot mapping does."""
    layout, left = [], np
    for name, slots in hosts:
        if left == 0:
            break
        take = min(slots, left)
        layout.append((name, take))
        left -= take
    return layout


# ----------------------------------------------------------------------------- one host

def _rank_groups(np: int, groups: int) -> list[range]:
    """np ranks in `groups` contiguous runs, sizes differing by at most one."""
    base, extra = divmod(np, groups)
    out, start = [], 0
    for g in range(groups):
        n = base + (1 if g < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


# Variables that size a rank's intra-op thread pool: OpenMP (torch, numpy's BLAS) and TensorFlow.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")


def threads_per_rank(ranks_on_host: int) -> int | None:
    """Intra-op threads each rank gets: the host's cores divided among its ranks, unless the
    user sized the pools. Every rank otherwise starts one thread per core, and ranks on one host
    oversubscribe the cores (the digits demo trained 4x slower on 2 cores with 2 ranks)."""
    if any(os.environ.get(v) for v in _THREAD_VARIABLES):
        return None
    return max(1, _usable_cores() // max(1, ranks_on_host))


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _child_envs(np: int, simulate_hosts: int | None) -> list[dict[str, str]]:
    # Outside the ephemeral range (ports.py says why) and not adjacent: discovery prefers
    # SMDDP_STORE_PORT over MASTER_PORT+1, but a torch script may still open MASTER_PORT+1.
    store_port, master_port = free_listen_ports(2)
    # Simulated hosts share this machine's cores: divide them over every rank here.
    threads = threads_per_rank(np)
    if threads is not None:
        print(f"smddprun: {np} ranks on this host's {_usable_cores()} cores: each gets OMP_NUM_THREADS="
              f"{threads} and TF_NUM_INTRAOP_THREADS={threads} (set either to choose)", file=sys.stderr, flush=True)
    common = {
        "SMDDP_SIZE": str(np),
        "SMDDP_STORE_ADDR": "127.0.0.1",
        "SMDDP_STORE_PORT": str(store_port),
        "SMDDP_SECRET": secrets.token_hex(16),
        "WORLD_SIZE": str(np),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    }
    envs = []
    for g, ranks in enumerate(_rank_groups(np, simulate_hosts or 1)):
        for local_rank, rank in enumerate(ranks):
            env = dict(os.environ)
            env.update(common)
            if threads is not None:
                env.update({v: str(threads) for v in _THREAD_VARIABLES})
            env.update({
                "SMDDP_RANK": str(rank), "RANK": str(rank),
                "SMDDP_LOCAL_RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
                "SMDDP_LOCAL_SIZE": str(len(ranks)), "LOCAL_WORLD_SIZE": str(len(ranks)),
                # The original launcher's names, which clients (Hugging Face transformers) read.
                "SMDATAPARALLEL_RANK": str(rank), "SMDATAPARALLEL_SIZE": str(np),
                "SMDATAPARALLEL_LOCAL_RANK": str(local_rank), "SMDATAPARALLEL_LOCAL_SIZE": str(len(ranks)),
                "SMDATAPARALLEL_SERVER_ADDR": common["MASTER_ADDR"],
                "SMDATAPARALLEL_SERVER_PORT": common["MASTER_PORT"],
            })
            if simulate_hosts:
                # Asked for explicitly, so it wins over a SMDDP_HOST the user exported;
                # without the option the user's SMDDP_HOST passes through untouched.
                env["SMDDP_HOST"] = f"simhost{g}"
            envs.append(env)
    return envs


def _death_signal_hook():
    """A preexec function making the kernel SIGTERM a rank if smddprun dies (Linux).

    Ranks run in process groups of their own (so that stopping one reaches its
    children too, and a terminal's Ctrl-C reaches them once, through smddprun);
    without this they would outlive a smddprun killed with SIGKILL.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def hook():
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # smddprun died before the call took effect
            os._exit(1)

    return hook


def _pump(pipe, out, prefix: bytes, lock: threading.Lock) -> None:
    """Copy a rank's output line by line, each line prefixed with its rank."""
    with pipe:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                try:
                    out.write(prefix + line)
                    out.flush()
                except (OSError, ValueError):
                    # Our own output is gone (closed pipe); keep reading so the rank
                    # never blocks on a full pipe.
                    pass


def _status_text(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-rc} ({name})"
    return f"exited with status {rc}"


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


_SHM_DIR = "/dev/shm"


class _Supervisor:
    """Runs the ranks of one host until all exit, one fails, or a signal arrives."""

    def __init__(self, command: list[str], envs: list[dict[str, str]]):
        self.command = command
        self.envs = envs
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.out_lock = threading.Lock()
        self.err_lock = threading.Lock()
        self.signal_received: int | None = None
        self.kill_at: float | None = None

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            # Only unreaped children: a reaped one's pid may already belong to someone else.
            if p.returncode is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _stop_all(self) -> None:
        """SIGTERM every rank now, SIGKILL whatever is left after the grace period."""
        self._signal_all(signal.SIGTERM)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + _GRACE_S

    def _on_signal(self, signum, frame) -> None:
        if self.signal_received is None:
            self.signal_received = signum
            self._signal_all(signum)
            self.kill_at = time.monotonic() + _GRACE_S
        else:
            # A second signal means the user does not want to wait.
            self._signal_all(signal.SIGKILL)

    def _say(self, msg: str) -> None:
        with self.err_lock:
            print(f"{PROG}: {msg}", file=sys.stderr, flush=True)

    def _start(self) -> None:
        hook = _death_signal_hook()
        for env in self.envs:
            self.procs.append(subprocess.Popen(
                self.command, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                process_group=0, preexec_fn=hook))

    def _start_pumps(self) -> None:
        out = getattr(sys.stdout, "buffer", sys.stdout)
        err = getattr(sys.stderr, "buffer", sys.stderr)
        for rank, p in enumerate(self.procs):
            prefix = f"[{rank}] ".encode()
            for pipe, stream, lock in ((p.stdout, out, self.out_lock), (p.stderr, err, self.err_lock)):
                t = threading.Thread(target=_pump, args=(pipe, stream, prefix, lock), daemon=True)
                t.start()
                self.threads.append(t)

    def run(self) -> int:
        # All ranks are started before any thread or signal handler exists: the
        # preexec hook runs in the forked child, where neither may interfere.
        try:
            self._start()
        except OSError as e:
            # Nothing reads their output yet, so do not wait for a graceful exit.
            self._signal_all(signal.SIGKILL)
            for p in self.procs:
                p.wait()
            self._say(f"cannot start {shlex.join(self.command)}: {e}")
            return 127
        previous = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
        try:
            self._start_pumps()
            failure = self._wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self._drain()
        self._remove_shared_memory()
        if self.signal_received is not None:
            return 128 + self.signal_received
        if failure is not None:
            return _exit_code(failure[1])
        return 0

    def _remove_shared_memory(self) -> None:
        """A host's segment is unlinked by its leader as soon as every local rank has mapped it;
        a leader killed inside that window leaves it in /dev/shm. Its name ends with the
        leader's pid (native/comm.cc), so the segments of this job's ranks are removed here."""
        pids = {str(p.pid) for p in self.procs}
        try:
            names = os.listdir(_SHM_DIR)
        except OSError:
            return
        for name in names:
            if name.startswith("smddp-") and name.rsplit("-", 1)[-1] in pids:
                try:
                    os.unlink(os.path.join(_SHM_DIR, name))
                    self._say(f"removed the shared memory {name} that a killed rank left behind")
                except OSError:
                    pass

    def _wait(self) -> tuple[int, int] | None:
        """Poll until every rank has exited; the first failure stops the rest."""
        failure = None
        while any(p.returncode is None for p in self.procs):
            for rank, p in enumerate(self.procs):
                if p.returncode is not None or p.poll() is None:
                    continue
                if p.returncode != 0 and failure is None and self.signal_received is None:
                    failure = (rank, p.returncode)
                    self._say(f"rank {rank} {_status_text(p.returncode)}; stopping the other ranks")
                    self._stop_all()
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self._signal_all(signal.SIGKILL)
                self.kill_at = None
            time.sleep(_POLL_S)
        return failure

    def _drain(self) -> None:
        deadline = time.monotonic() + _DRAIN_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _run_here(np: int, simulate_hosts: int | None, command: list[str], dry_run: bool) -> int:
    envs = _child_envs(np, simulate_hosts)
    if dry_run:
        for rank, env in enumerate(envs):
            where = f" on {env['SMDDP_HOST']}" if simulate_hosts else ""
            print(f"rank {rank}{where} (local {env['SMDDP_LOCAL_RANK']} of "
                  f"{env['SMDDP_LOCAL_SIZE']}): {shlex.join(command)}")
        return 0
    return _Supervisor(command, envs).run()


# ----------------------------------------------------------------------------- several hosts

def _is_open_mpi(mpirun: str) -> bool:
    try:
        r = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    text = r.stdout + r.stderr
    return "Open MPI" in text or "OpenRTE" in text


def _torchrun_target(command: list[str]) -> list[str]:
    """What follows torchrun's options: a script or -m module, else --no_python command."""
    if re.fullmatch(r"python[0-9.]*", os.path.basename(command[0])) and len(command) > 1:
        rest = command[1:]
        if not rest[0].startswith("-") or (rest[0] == "-m" and len(rest) > 1):
            return rest
    return ["--no_python", *command]


def _hints(layout: list[tuple[str, int]], np: int, command: list[str], port: int) -> str:
    first = layout[0][0]
    per_node = {n for _, n in layout}
    srun = ["srun", f"--nodes={len(layout)}", f"--ntasks={np}"]
    if len(per_node) == 1:
        srun.append(f"--ntasks-per-node={per_node.pop()}")
    srun += [f"--nodelist={','.join(h for h, _ in layout)}", *command]
    lines = [
        "Every rank needs the same secret; export one on every host, e.g.",
        f"  export SMDDP_SECRET={secrets.token_hex(16)}",
        "then run the job with srun (rank 0 runs on the first node Slurm lists; MASTER_ADDR must name it):",
        f"  MASTER_ADDR={first} MASTER_PORT={port} {shlex.join(srun)}",
        "or with torchrun, on each host:",
    ]
    for i, (host, n) in enumerate(layout):
        tr = ["torchrun", "--nnodes", str(len(layout)), "--node_rank", str(i),
              "--nproc_per_node", str(n), "--master_addr", first, "--master_port", str(port),
              *_torchrun_target(command)]
        lines.append(f"  on {host}: {shlex.join(tr)}")
    return "\n".join(lines)


def _run_hosts(hosts: list[tuple[str, int]], np: int, command: list[str], dry_run: bool) -> int:
    layout = _layout(hosts, np)
    first = layout[0][0]
    # Ports cannot be probed on the other hosts: pick one at random below the kernel's
    # ephemeral range (ports.py says why), and put our store next to torch's.
    master_port = PORTS_LOWEST + secrets.randbelow(PORTS_HIGHEST - PORTS_LOWEST - 1)
    mpirun = shutil.which("mpirun")
    if mpirun is None or not _is_open_mpi(mpirun):
        why = "mpirun is not on PATH" if mpirun is None else f"{mpirun} is not Open MPI's"
        print(f"{PROG}: cannot start ranks on several hosts: {why}.\n"
              f"{_hints(layout, np, command, master_port)}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.update({
        "SMDDP_SECRET": secrets.token_hex(16),
        "SMDDP_STORE_ADDR": first,
        "SMDDP_STORE_PORT": str(master_port + 1),
        "MASTER_ADDR": first,
        "MASTER_PORT": str(master_port),
    })
    # -x exports a variable by name: the secret's value never shows on a command line.
    exported = ["SMDDP_SECRET", "SMDDP_STORE_ADDR", "SMDDP_STORE_PORT", "MASTER_ADDR",
                "MASTER_PORT", "PATH"]
    if "PYTHONPATH" in env:  # Open MPI complains about -x of an unset variable
        exported.append("PYTHONPATH")
    argv = ["mpirun", "-np", str(np), "-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    for name in exported:
        argv += ["-x", name]
    argv += ["--tag-output", *command]
    print(shlex.join(argv), flush=True)
    if dry_run:
        return 0
    # mpirun does its own signal forwarding and exit status; step aside for it.
    os.execve(mpirun, argv, env)
    return 0  # not reached


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.help:
        _print_help(parser)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _error("no command given (see --help)")

    hosts = None
    if args.hosts is not None:
        try:
            hosts = _parse_hosts(args.hosts)
        except ValueError as e:
            return _error(str(e))
    slots = sum(s for _, s in hosts) if hosts else None
    np = args.np if args.np is not None else slots
    if np is None:
        return _error("give the number of ranks with -np N")
    if np < 1:
        return _error(f"-np {np}: need at least one rank")
    if slots is not None and np > slots:
        return _error(f"-np {np} exceeds the {slots} slots that -H offers")

    several = hosts is not None and not all(_is_this_host(h) for h, _ in hosts)
    if args.simulate_hosts is not None:
        if several:
            return _error("--simulate-hosts splits ranks on this host; it does not mix with other hosts in -H")
        if not 1 <= args.simulate_hosts <= np:
            return _error(f"--simulate-hosts {args.simulate_hosts}: need between 1 and {np} hosts")
    if several:
        return _run_hosts(hosts, np, command, args.dry_run)
    return _run_here(np, args.simulate_hosts, command, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
