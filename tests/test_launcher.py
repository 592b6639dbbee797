"""smddprun end to end: it is run as a subprocess, starting small Python programs as ranks.

Every wait has a generous timeout that only guards against hangs; no test asserts
how fast anything happens.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

HANG_GUARD_S = 120
LAUNCHER = [sys.executable, "-m", "smdistributed.common.launcher"]


def smddprun(*args, env=None, **kw):
    return subprocess.run([*LAUNCHER, *args], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env=env, **kw)


def rank_program(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def by_rank(text: str) -> dict[int, list[str]]:
    """Lines of prefixed output grouped by rank (each rank's lines stay in order)."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("["):
            rank, _, rest = line.partition("] ")
            out.setdefault(int(rank[1:]), []).append(rest)
    return out


def wait_for_files(paths, proc):
    """Wait until the ranks signal readiness by creating files (a hang guard, not a timing check)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(os.path.exists(p) for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks never became ready"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ranks_get_their_variables_and_prefixed_output():
    prog = rank_program("""
        import os, sys
        keys = ["SMDDP_RANK", "SMDDP_SIZE", "SMDDP_LOCAL_RANK", "SMDDP_LOCAL_SIZE", "RANK",
                "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SMDDP_STORE_ADDR",
                "SMDDP_STORE_PORT", "MASTER_ADDR", "MASTER_PORT", "SMDDP_SECRET", "PYTHONUNBUFFERED"]
        print(" ".join(f"{k}={os.environ[k]}" for k in keys))
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """)
    r = smddprun("-np", "3", "--", *prog)
    assert r.returncode == 0, r.stderr
    out, err = by_rank(r.stdout), by_rank(r.stderr)
    assert sorted(out) == [0, 1, 2] and sorted(err) == [0, 1, 2]
    seen = {}
    for rank, lines in out.items():
        assert lines[1] == "no newline at the end"
        env = dict(kv.split("=", 1) for kv in lines[0].split())
        assert env["SMDDP_RANK"] == env["RANK"] == env["SMDDP_LOCAL_RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["SMDDP_SIZE"] == env["WORLD_SIZE"] == env["SMDDP_LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["SMDDP_STORE_ADDR"] == env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert int(env["MASTER_PORT"]) + 1 != int(env["SMDDP_STORE_PORT"])
        assert int(env["MASTER_PORT"]) != int(env["SMDDP_STORE_PORT"])
        assert len(env["SMDDP_SECRET"]) == 32
        seen[rank] = (env["SMDDP_STORE_PORT"], env["MASTER_PORT"], env["SMDDP_SECRET"])
        assert err[rank] == ["to stderr"]
    assert len(set(seen.values())) == 1  # one job: the same store, port and secret everywhere


def test_ranks_discover_themselves():
    prog = rank_program("""
        from smdistributed.common.discovery import discover
        w = discover()
        print(w.rank, w.size, w.local_rank, w.local_size, w.launcher)
    """)
    r = smddprun("-np", "2", *prog)
    assert r.returncode == 0, r.stderr
    assert by_rank(r.stdout) == {0: ["0 2 0 2 smddprun"], 1: ["1 2 1 2 smddprun"]}


def test_simulated_hosts_split_ranks_into_contiguous_groups():
    prog = rank_program("""
        from smdistributed.common.discovery import discover
        w = discover()
        print(w.host, w.local_rank, w.local_size)
    """)
    r = smddprun("-np", "4", "--simulate-hosts", "2", "--", *prog)
    assert r.returncode == 0, r.stderr
    assert by_rank(r.stdout) == {0: ["simhost0 0 2"], 1: ["simhost0 1 2"],
                                 2: ["simhost1 0 2"], 3: ["simhost1 1 2"]}


def test_failing_rank_stops_the_others_and_sets_the_exit_status(tmp_path):
    prog = rank_program(f"""
        import os, sys, time
        rank = os.environ["RANK"]
        d = {str(tmp_path)!r}
        if rank == "1":
            # Fail only once the others are asleep, so that they must be stopped.
            while not all(os.path.exists(os.path.join(d, r)) for r in ("0", "2")):
                time.sleep(0.05)
            sys.exit(3)
        with open(os.path.join(d, rank + ".tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(d, rank + ".tmp"), os.path.join(d, rank))
        time.sleep(600)
    """)
    r = smddprun("-np", "3", "--", *prog)
    assert r.returncode == 3, r.stderr
    assert "rank 1 exited with status 3" in r.stderr
    for rank in ("0", "2"):
        assert gone(int((tmp_path / rank).read_text()))


def test_rank_killed_by_a_signal_gives_128_plus_the_signal():
    prog = rank_program("""
        import os, signal
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = smddprun("-np", "2", "--", *prog)
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by signal 9 (SIGKILL)" in r.stderr


def test_sigterm_is_forwarded_to_every_rank(tmp_path):
    prog = rank_program(f"""
        import os, signal, sys, time
        def stop(signum, frame):
            print("got", signal.Signals(signum).name, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        open(os.path.join({str(tmp_path)!r}, os.environ["RANK"]), "w").close()
        time.sleep(600)
    """)
    proc = subprocess.Popen([*LAUNCHER, "-np", "3", "--", *prog],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / str(r) for r in range(3)], proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert by_rank(out) == {r: ["got SIGTERM"] for r in range(3)}


def test_localhost_in_hosts_runs_here():
    r = smddprun("-H", "localhost:2", "--", sys.executable, "-c", "print('hi')")
    assert r.returncode == 0, r.stderr
    assert by_rank(r.stdout) == {0: ["hi"], 1: ["hi"]}


def test_help_lists_usage_launch_methods_and_configuration():
    r = smddprun("--help")
    assert r.returncode == 0
    for text in ("usage: smddprun -np N", "mpirun", "srun", "torchrun", "--simulate-hosts",
                 "Configuration"):
        assert text in r.stdout
    try:
        from smdistributed.common.config import config_table
        table = config_table()  # needs the built native core
    except ImportError:
        assert "configuration table unavailable" in r.stdout
    else:
        for name, _default, _meaning in table:
            assert name in r.stdout


def test_help_formats_the_configuration_table(monkeypatch, capsys):
    from types import SimpleNamespace

    from smdistributed.common import launcher

    fake = SimpleNamespace(config_table=lambda: [("SMDDP_TIMEOUT", "60", "seconds before a peer is dead"),
                                                 ("SMDDP_HOST", "", "host key override")])
    monkeypatch.setattr(launcher.importlib, "import_module", lambda name: fake)
    assert launcher.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  SMDDP_TIMEOUT  60       seconds before a peer is dead" in out
    assert "  SMDDP_HOST              host key override" in out


@pytest.mark.parametrize("args, message", [
    (["-np", "2"], "no command given"),
    ([sys.executable, "-c", "pass"], "-np N"),
    (["-np", "3", "-H", "localhost:2", "true"], "exceeds the 2 slots"),
    (["-np", "2", "--simulate-hosts", "3", "true"], "--simulate-hosts 3"),
])
def test_usage_errors(args, message):
    r = smddprun(*args)
    assert r.returncode == 2
    assert message in r.stderr


HOSTS = "smddp-test-a.invalid:2,smddp-test-b.invalid:2"


def test_several_hosts_dry_run_prints_the_mpirun_line(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.5'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = smddprun("-np", "4", "-H", HOSTS, "--dry-run", "--", "python", "train.py", env=env)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith(f"mpirun -np 4 -H {HOSTS} ")
    for name in ("SMDDP_SECRET", "SMDDP_STORE_ADDR", "SMDDP_STORE_PORT", "MASTER_ADDR",
                 "MASTER_PORT", "PATH"):
        assert f"-x {name} " in line
    assert line.endswith("--tag-output python train.py")


def test_several_hosts_without_mpirun_shows_srun_and_torchrun(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty directory: no mpirun anywhere
    r = smddprun("-np", "4", "-H", HOSTS, "--dry-run", "--", "python", "train.py", "--lr", "1",
                 env=env)
    assert r.returncode == 2
    assert "mpirun is not on PATH" in r.stderr
    assert "srun --nodes=2 --ntasks=4 --ntasks-per-node=2" in r.stderr
    assert "MASTER_ADDR=smddp-test-a.invalid" in r.stderr
    assert ("torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 "
            "--master_addr smddp-test-a.invalid") in r.stderr
    assert "train.py --lr 1" in r.stderr


def _dead_or_zombie(pid: int) -> bool:
    # An orphan's zombie may linger where PID 1 does not reap; it is dead all the same.
    if gone(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses the Linux parent-death signal")
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    prog = rank_program(f"""
        import os, time
        with open(os.path.join({str(tmp_path)!r}, os.environ["RANK"] + ".tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join({str(tmp_path)!r}, os.environ["RANK"] + ".tmp"),
                  os.path.join({str(tmp_path)!r}, os.environ["RANK"]))
        time.sleep(600)
    """)
    proc = subprocess.Popen([*LAUNCHER, "-np", "2", "--", *prog],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_files([tmp_path / "0", tmp_path / "1"], proc)
    finally:
        proc.kill()
        proc.wait(timeout=HANG_GUARD_S)
    pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(_dead_or_zombie(p) for p in pids):
        assert time.monotonic() < deadline, "ranks survived the launcher"
        time.sleep(0.05)


def test_threads_divided_among_local_ranks():
    """Each rank gets the host's cores divided by its ranks as OMP_NUM_THREADS and
    TF_NUM_INTRAOP_THREADS (said once on stderr), unless the user chose a count."""
    cores = len(os.sched_getaffinity(0))
    program = rank_program("import os; print(os.environ['OMP_NUM_THREADS'], os.environ['TF_NUM_INTRAOP_THREADS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")}
    out = smddprun("-np", "2", *program, env=env)
    assert out.returncode == 0, out.stderr
    want = str(max(1, cores // 2))
    assert all(lines == [f"{want} {want}"] for lines in by_rank(out.stdout).values()), out.stdout
    assert out.stderr.count("OMP_NUM_THREADS=") == 1, out.stderr
    out = smddprun("-np", "2", *rank_program("import os; print(os.environ['OMP_NUM_THREADS'])"),
                   env=dict(env, OMP_NUM_THREADS="3"))
    assert all(lines == ["3"] for lines in by_rank(out.stdout).values()), out.stdout
    assert "OMP_NUM_THREADS=" not in out.stderr


def test_segment_of_a_leader_killed_during_startup_is_removed():
    """A host leader SIGKILLed after creating its shared memory segment and before the others
    mapped it (so before it unlinks it) leaves /dev/shm/smddp-<hash>-<its pid>; smddprun
    removes it. (The leader stands in here with a file of that name: the engine's own window
    is too short to hit on purpose.)"""
    program = rank_program("""
        import os, signal
        if os.environ["SMDDP_LOCAL_RANK"] == "0":
            open(f"/dev/shm/smddp-0123abcd-{os.getpid()}", "wb").close()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    before = {n for n in os.listdir("/dev/shm") if n.startswith("smddp-")}
    out = smddprun("-np", "2", *program)
    assert out.returncode != 0
    after = {n for n in os.listdir("/dev/shm") if n.startswith("smddp-")}
    assert after <= before, (after - before, out.stderr)
    assert "removed the shared memory smddp-0123abcd-" in out.stderr, out.stderr
