"""Rank discovery from each launcher's variables, its precedence and its error messages."""

import socket
import warnings

import pytest

from smdistributed.common import discovery
from smdistributed.common.discovery import DiscoveryError, discover


def world(**env):
    """discover() on exactly these variables, the derived-secret warning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover(env)


def fails(match, **env):
    with pytest.raises(DiscoveryError, match=match):
        world(**env)


# ------------------------------------------------------------------ each launcher

def test_plain_process_is_a_world_of_one():
    w = world()
    assert (w.rank, w.size, w.local_rank, w.local_size) == (0, 1, 0, 1)
    assert w.launcher == "single"
    assert w.store_port == 0 and w.secret == ""
    assert w.store_addr == "127.0.0.1"
    assert w.host == socket.gethostname()


def test_smddprun_variables():
    w = world(SMDDP_RANK="2", SMDDP_SIZE="4", SMDDP_LOCAL_RANK="0", SMDDP_LOCAL_SIZE="2",
              SMDDP_STORE_ADDR="10.0.0.1", SMDDP_STORE_PORT="1234", SMDDP_SECRET="s3",
              SMDDP_HOST="simhost1")
    assert (w.rank, w.size, w.local_rank, w.local_size) == (2, 4, 0, 2)
    assert (w.store_addr, w.store_port, w.secret) == ("10.0.0.1", 1234, "s3")
    assert w.launcher == "smddprun" and w.host == "simhost1"


def test_torchrun_variables_put_the_store_next_to_master_port():
    w = world(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
              MASTER_ADDR="node1", MASTER_PORT="29500")
    assert (w.rank, w.size, w.local_rank, w.local_size) == (3, 4, 1, 2)
    assert (w.store_addr, w.store_port, w.launcher) == ("node1", 29501, "torchrun")


def test_torchrun_without_local_world_size_on_one_host():
    w = world(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert (w.local_rank, w.local_size) == (1, 2)
    w = world(RANK="1", WORLD_SIZE="2", SMDDP_STORE_PORT="4000")
    assert (w.local_rank, w.local_size) == (1, 2)


def test_torchrun_without_local_world_size_across_hosts_leaves_local_unknown():
    w = world(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="node1", MASTER_PORT="29500")
    assert (w.local_rank, w.local_size) == (-1, -1)


def test_openmpi_variables_derive_port_and_secret_from_the_job_id():
    base = dict(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_SIZE="4",
                OMPI_MCA_ess_base_jobid="12345", MASTER_ADDR="127.0.0.1")
    ranks = [world(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r), **base)
             for r in range(4)]
    assert [w.rank for w in ranks] == [0, 1, 2, 3]
    assert all(w.launcher == "openmpi" and w.local_size == 4 for w in ranks)
    # Every rank must arrive at the same store port and secret on its own.
    assert len({w.store_port for w in ranks}) == 1 and len({w.secret for w in ranks}) == 1
    assert 20000 <= ranks[0].store_port < 30000
    assert len(ranks[0].secret) == 64
    other_job = world(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_LOCAL_RANK="0",
                      **{**base, "OMPI_MCA_ess_base_jobid": "999"})
    assert other_job.secret != ranks[0].secret


def test_openmpi_5_uses_the_pmix_namespace():
    w = world(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", PMIX_NAMESPACE="prterun-x-1@1")
    assert 20000 <= w.store_port < 30000


def test_mpich_variables():
    w = world(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2", PMI_PORT="h:5")
    assert (w.rank, w.size, w.local_rank, w.local_size, w.launcher) == (1, 2, 1, 2, "mpich")


def test_mpich_without_local_variables_leaves_local_unknown():
    w = world(PMI_RANK="1", PMI_SIZE="2", MASTER_PORT="29500")
    assert (w.local_rank, w.local_size) == (-1, -1)


SRUN = dict(SLURM_PROCID="5", SLURM_NTASKS="7", SLURM_LOCALID="1", SLURM_JOB_ID="77",
            SLURM_STEP_ID="0", SLURM_TASKS_PER_NODE="2(x3),1", SLURM_NODEID="2",
            MASTER_ADDR="node1")


def test_slurm_variables_with_compressed_tasks_per_node():
    w = world(**SRUN)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.launcher) == (5, 7, 1, 2, "slurm")
    assert 20000 <= w.store_port < 30000
    last = world(**{**SRUN, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"})
    assert (last.local_rank, last.local_size) == (0, 1)
    assert last.store_port == w.store_port


def test_slurm_prefers_the_step_layout_and_ntasks_per_node():
    w = world(**{**SRUN, "SLURM_NTASKS_PER_NODE": "3", "SLURM_STEP_NUM_TASKS": "6"})
    assert (w.size, w.local_size) == (6, 3)


def test_slurm_unparseable_tasks_per_node_leaves_local_unknown():
    w = world(**{**SRUN, "SLURM_TASKS_PER_NODE": "weird"})
    assert (w.local_rank, w.local_size) == (-1, -1)


def test_slurm_batch_shell_without_srun_is_a_single_process():
    # sbatch's own shell has SLURM_PROCID=0 and the allocation's task count.
    w = world(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_JOB_ID="77", SLURM_LOCALID="0")
    assert (w.size, w.launcher) == (1, "single")


def test_horovod_variables():
    w = world(HOROVOD_RANK="1", HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK="1", HOROVOD_LOCAL_SIZE="2",
              HOROVOD_GLOO_RENDEZVOUS_ADDR="h", HOROVOD_GLOO_RENDEZVOUS_PORT="1")
    assert (w.rank, w.size, w.local_rank, w.local_size, w.launcher) == (1, 2, 1, 2, "horovod")


def test_sagemaker_hosts_one_process_each():
    env = dict(SM_HOSTS='["algo-1", "algo-2", "algo-3"]', SM_CURRENT_HOST="algo-2",
               SM_NUM_GPUS="8", TRAINING_JOB_NAME="job")
    w = world(**env)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.launcher) == (1, 3, 0, 1, "sagemaker")
    assert (w.host, w.store_addr) == ("algo-2", "algo-1")
    assert world(**{**env, "SM_CURRENT_HOST": "algo-1"}).store_port == w.store_port


# ------------------------------------------------------------------ precedence

def test_smddprun_wins_over_the_torch_variables_it_also_sets():
    w = world(SMDDP_RANK="1", SMDDP_SIZE="2", RANK="1", WORLD_SIZE="2", SMDDP_STORE_PORT="5")
    assert w.launcher == "smddprun"


def test_torchrun_wins_over_mpi():
    w = world(RANK="1", WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2",
              PMI_RANK="1", PMI_SIZE="2", MASTER_PORT="29500")
    assert w.launcher == "torchrun"


def test_mpi_wins_over_sagemaker():
    w = world(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="16", MASTER_PORT="1",
              SM_HOSTS='["algo-1", "algo-2"]', SM_CURRENT_HOST="algo-1")
    assert (w.rank, w.size, w.launcher) == (5, 16, "openmpi")


def test_enclosing_launcher_with_a_smaller_world_is_accepted():
    # srun starting one torchrun on each of 2 nodes, 4 workers each.
    w = world(RANK="6", WORLD_SIZE="8", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4",
              MASTER_ADDR="node1", MASTER_PORT="29500",
              SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_JOB_ID="7")
    assert (w.rank, w.launcher) == (6, "torchrun")


def test_store_variables_precedence():
    w = world(SMDDP_STORE_ADDR="a", MASTER_ADDR="b", SMDDP_STORE_PORT="7", MASTER_PORT="9")
    assert (w.store_addr, w.store_port) == ("a", 7)


def test_empty_variables_count_as_unset():
    assert world(RANK="", WORLD_SIZE=" ").launcher == "single"


def test_smddp_host_overrides_the_host_name():
    assert world(SMDDP_HOST="simhost3").host == "simhost3"


def test_smddp_secret_is_used_as_given():
    assert world(PMI_RANK="0", PMI_SIZE="2", MASTER_PORT="1", SMDDP_SECRET="abc").secret == "abc"


def test_derived_secret_warns_once(monkeypatch):
    monkeypatch.setattr(discovery, "_warned_derived_secret", False)
    env = dict(PMI_RANK="0", PMI_SIZE="2", MASTER_PORT="29500")
    with pytest.warns(UserWarning, match="smddprun sets a random one"):
        discover(env)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        discover(env)  # a second warning would raise here


# ------------------------------------------------------------------ errors

def test_rank_outside_world():
    fails(r"SMDDP_RANK=4 is outside \[0, SMDDP_SIZE=4\)", SMDDP_RANK="4", SMDDP_SIZE="4")
    fails(r"RANK=-1 is outside", RANK="-1", WORLD_SIZE="4")


def test_local_rank_outside_local_world():
    fails(r"OMPI_COMM_WORLD_LOCAL_RANK=2 is outside \[0, OMPI_COMM_WORLD_LOCAL_SIZE=2\)",
          OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4",
          OMPI_COMM_WORLD_LOCAL_RANK="2", OMPI_COMM_WORLD_LOCAL_SIZE="2")


def test_size_below_one():
    fails(r"SMDDP_SIZE=0 .*at least 1", SMDDP_RANK="0", SMDDP_SIZE="0")


def test_non_integer_value():
    fails(r"WORLD_SIZE='four' is not an integer", RANK="0", WORLD_SIZE="four")
    fails(r"HOROVOD_LOCAL_RANK='x' is not an integer",
          HOROVOD_RANK="0", HOROVOD_SIZE="1", HOROVOD_LOCAL_RANK="x", HOROVOD_LOCAL_SIZE="1")


def test_local_size_larger_than_world():
    fails(r"LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4",
          RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8")


def test_rank_without_size():
    fails(r"RANK is set but WORLD_SIZE is missing", RANK="0")
    fails(r"PMI_SIZE is set but PMI_RANK is missing", PMI_SIZE="2")


def test_sources_disagreeing_on_rank():
    fails(r"RANK=1 \(torchrun\) disagrees with OMPI_COMM_WORLD_RANK=0 \(openmpi\)",
          RANK="1", WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
          MASTER_PORT="29500")


def test_sources_disagreeing_on_size():
    fails(r"WORLD_SIZE=2 \(torchrun\) disagrees with OMPI_COMM_WORLD_SIZE=4 \(openmpi\)",
          RANK="1", WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4",
          MASTER_PORT="29500")


def test_smddprun_disagreeing_with_horovod():
    fails(r"SMDDP_RANK=0 \(smddprun\) disagrees with HOROVOD_RANK=1",
          SMDDP_RANK="0", SMDDP_SIZE="2", HOROVOD_RANK="1", HOROVOD_SIZE="2", SMDDP_STORE_PORT="5")


def test_world_without_a_job_id_or_port():
    fails(r"MASTER_ADDR and MASTER_PORT.*SMDDP_STORE_ADDR and SMDDP_STORE_PORT",
          OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")


def test_several_hosts_need_a_store_address():
    fails(r"OMPI_COMM_WORLD_LOCAL_SIZE=2 < OMPI_COMM_WORLD_SIZE=4.*Set MASTER_ADDR",
          OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="0",
          OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid="1")


def test_explicit_loopback_store_with_simulated_hosts_is_fine():
    w = world(SMDDP_RANK="3", SMDDP_SIZE="4", SMDDP_LOCAL_RANK="1", SMDDP_LOCAL_SIZE="2",
              SMDDP_STORE_ADDR="127.0.0.1", SMDDP_STORE_PORT="4000", SMDDP_HOST="simhost1")
    assert w.store_addr == "127.0.0.1"


def test_port_out_of_range():
    fails(r"MASTER_PORT='65535'", RANK="0", WORLD_SIZE="2", MASTER_PORT="65535")
    fails(r"SMDDP_STORE_PORT='0'", RANK="0", WORLD_SIZE="2", SMDDP_STORE_PORT="0")


def test_bad_sagemaker_variables():
    fails(r"SM_HOSTS='algo-1' is not a JSON list", SM_HOSTS="algo-1", SM_CURRENT_HOST="algo-1")
    fails(r"SM_CURRENT_HOST='algo-9' is not one of SM_HOSTS",
          SM_HOSTS='["algo-1"]', SM_CURRENT_HOST="algo-9")
    fails(r"SM_CURRENT_HOST is missing", SM_HOSTS='["algo-1"]')


# ------------------------------------------------------------------ ports for a job's store

def test_listen_ports_are_free_distinct_not_adjacent_and_outside_the_ephemeral_range():
    from smdistributed.common import ports

    low, high = ports.ephemeral_range()
    chosen = ports.free_listen_ports(12)
    assert len(set(chosen)) == 12
    assert all(abs(a - b) > 1 for a in chosen for b in chosen if a != b), chosen
    assert all(not low <= p <= high and 1024 <= p < 65535 for p in chosen), (chosen, low, high)
    if low > ports.HIGHEST:  # Linux's default range: the preferred span is below it
        assert all(ports.LOWEST <= p < ports.HIGHEST for p in chosen), chosen
    for p in chosen:  # nothing holds them
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))


def test_listen_ports_skip_held_ports_and_fall_back_when_the_range_covers_everything(monkeypatch):
    from smdistributed.common import ports

    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        assert not ports._bindable(holder.getsockname()[1])
    # A (pretended) ephemeral range that leaves only the top ports outside it; 65535 is never
    # taken, since a store may listen on MASTER_PORT + 1.
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65400))
    assert ports._candidates() == [(65401, 65534)]
    assert all(65401 <= p <= 65534 for p in ports.free_listen_ports(3))
    # One that covers every port: the kernel picks them, still distinct and not adjacent.
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    assert ports._candidates() == []
    chosen = ports.free_listen_ports(3)
    assert all(abs(a - b) > 1 for a in chosen for b in chosen if a != b), chosen
