"""Find out who this process is in the job, from the variables its launcher set.

Every launcher people use (our smddprun, torchrun, mpirun of Open MPI or MPICH,
Slurm's srun, horovodrun, SageMaker) describes the world in its own variables.
`discover()` reads them in a fixed order of precedence, checks them against each
other, and adds what the rendezvous needs: the address and port of the TCP store
that rank 0 serves, and the secret every connection presents.

Local rank and local size are -1 where the launcher does not say them; the core
then computes them by grouping ranks on their host keys.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import socket
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Mapping

from smdistributed.common.ports import HIGHEST as PORTS_HIGHEST, LOWEST as PORTS_LOWEST


class DiscoveryError(RuntimeError):
    """The environment does not describe a usable world; the message names the variables."""


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    size: int
    local_rank: int  # -1: unknown, the core computes it from host keys
    local_size: int  # -1: unknown, likewise
    host: str  # key that groups ranks into hosts
    store_addr: str
    store_port: int  # 0 only when size == 1
    secret: str = field(repr=False)  # "" only when size == 1; kept out of logs and reprs
    launcher: str = ""


@dataclass(frozen=True)
class _Found:
    """What one launcher's variables say, with the variable names for error messages."""

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    rank_var: str
    size_var: str
    local_rank_var: str
    local_size_var: str


# Launchers whose four variables mean exactly rank, size, local rank, local size.
# Order is precedence, except that torchrun, Slurm and SageMaker need code of their
# own and are slotted in by _SOURCES below.
_PLAIN = {
    "smddprun": ("SMDDP_RANK", "SMDDP_SIZE", "SMDDP_LOCAL_RANK", "SMDDP_LOCAL_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "horovod": ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
}

# Variables that identify the job identically on all of its ranks, per launcher: the
# store port and the fallback secret are derived from them. Only the chosen
# launcher's own are used, because variables of an enclosing scheduler (say Slurm's
# around an mpirun) differ between ranks started on different nodes.
_JOB_ID_VARS = {
    "openmpi": [("OMPI_MCA_ess_base_jobid",), ("OMPI_MCA_orte_ess_jobid",), ("PMIX_NAMESPACE",)],
    "mpich": [("PMIX_NAMESPACE",), ("PMI_PORT",)],
    "slurm": [("SLURM_JOB_ID", "SLURM_STEP_ID"), ("SLURM_JOBID", "SLURM_STEPID")],
    "horovod": [("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"),
                ("OMPI_MCA_ess_base_jobid",), ("PMIX_NAMESPACE",)],
    "torchrun": [("TORCHELASTIC_RUN_ID",)],
    "sagemaker": [("TRAINING_JOB_NAME",), ("SM_HOSTS",)],
}

_DEFAULT_STORE_ADDR = "127.0.0.1"
# Derived ports fall in ports.py's [LOWEST, HIGHEST), below Linux's ephemeral range, where no
# socket is given a port unless it names it (ports.py says why that matters).
_PORT_BASE, _PORT_SPAN = PORTS_LOWEST, PORTS_HIGHEST - PORTS_LOWEST
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}

_warned_derived_secret = False


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value, or None when unset or empty (an empty `RANK=` means nothing)."""
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = _get(env, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise DiscoveryError(f"{name}={value!r} is not an integer") from None


def _required_pair(env, launcher, rank_var, size_var):
    """Rank and size of a launcher whose variables are present; both must be there."""
    rank, size = _int(env, rank_var), _int(env, size_var)
    if rank is None or size is None:
        have, missing = (rank_var, size_var) if rank is not None else (size_var, rank_var)
        raise DiscoveryError(
            f"{have} is set but {missing} is missing: a {launcher} environment needs both")
    return rank, size


def _local_pair(env, local_rank_var, local_size_var):
    """Local rank and size, or (-1, -1) unless both are given."""
    local_rank, local_size = _int(env, local_rank_var), _int(env, local_size_var)
    if local_rank is None or local_size is None:
        return -1, -1
    return local_rank, local_size


def _plain_source(launcher):
    rank_var, size_var, lr_var, ls_var = _PLAIN[launcher]

    def read(env):
        if _get(env, rank_var) is None and _get(env, size_var) is None:
            return None
        rank, size = _required_pair(env, launcher, rank_var, size_var)
        local_rank, local_size = _local_pair(env, lr_var, ls_var)
        return _Found(launcher, rank, size, local_rank, local_size,
                      rank_var, size_var, lr_var, ls_var)

    return read


def _is_loopback(addr: str) -> bool:
    if addr.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _torchrun(env):
    if _get(env, "RANK") is None and _get(env, "WORLD_SIZE") is None:
        return None
    rank, size = _required_pair(env, "torchrun", "RANK", "WORLD_SIZE")
    local_rank, local_size = _local_pair(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if _get(env, "LOCAL_WORLD_SIZE") is None:
        # Older torch.distributed.launch and hand-written launchers set no
        # LOCAL_WORLD_SIZE. When MASTER_ADDR is absent or a loopback address the job
        # can only be on this one host, so the local world is the world; otherwise
        # it is left unknown for the core to compute from host keys.
        master = _get(env, "MASTER_ADDR")
        if master is None or _is_loopback(master):
            lr = _int(env, "LOCAL_RANK")
            local_rank, local_size = (rank if lr is None else lr), size
    return _Found("torchrun", rank, size, local_rank, local_size,
                  "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _expand_tasks_per_node(spec: str) -> list[int] | None:
    """Slurm's compressed list, e.g. "2(x3),1" -> [2, 2, 2, 1]; None if malformed."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts or None


def _slurm_local_size(env) -> tuple[int, str]:
    """Tasks on this node and the variable it came from, or (-1, "") if not knowable."""
    # The step's own layout first: an srun may use fewer tasks than the allocation.
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        spec = _get(env, name)
        if spec is None:
            continue
        counts = _expand_tasks_per_node(spec)
        if counts is None:
            return -1, ""
        if len(set(counts)) == 1:
            return counts[0], name
        node = _get(env, "SLURM_NODEID")
        if node is not None and node.isdigit() and int(node) < len(counts):
            return counts[int(node)], name
        return -1, ""
    return -1, ""


def _slurm(env):
    # SLURM_PROCID alone is not enough: an sbatch script's own shell has
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS, although only one process
    # runs it. Only srun's tasks carry a step id.
    if _get(env, "SLURM_PROCID") is None:
        return None
    if _get(env, "SLURM_STEP_ID") is None and _get(env, "SLURM_STEPID") is None:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if _get(env, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    rank, size = _required_pair(env, "slurm", "SLURM_PROCID", size_var)
    local_rank = _int(env, "SLURM_LOCALID")
    local_size, ls_var = _slurm_local_size(env)
    # The local size is inferred from a layout string; when it does not fit the
    # local id the inference was wrong, so leave both to the core.
    if local_rank is None or local_size < 1 or not 0 <= local_rank < local_size:
        local_rank, local_size = -1, -1
    return _Found("slurm", rank, size, local_rank, local_size,
                  "SLURM_PROCID", size_var, "SLURM_LOCALID", ls_var)


def _sagemaker_hosts(env) -> list[str]:
    raw = _get(env, "SM_HOSTS")
    try:
        hosts = json.loads(raw)
    except ValueError:
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise DiscoveryError(f"SM_HOSTS={raw!r} is not a JSON list of host names")
    return hosts


def _sagemaker(env):
    # SageMaker describes hosts, not processes: this source means one process per
    # host and is used only when no launcher set per-process variables.
    if _get(env, "SM_HOSTS") is None:
        return None
    hosts = _sagemaker_hosts(env)
    current = _get(env, "SM_CURRENT_HOST")
    if current is None:
        raise DiscoveryError("SM_HOSTS is set but SM_CURRENT_HOST is missing")
    if current not in hosts:
        raise DiscoveryError(f"SM_CURRENT_HOST={current!r} is not one of SM_HOSTS={hosts}")
    return _Found("sagemaker", hosts.index(current), len(hosts), 0, 1,
                  "SM_CURRENT_HOST", "SM_HOSTS", "SM_CURRENT_HOST", "SM_HOSTS")


_SOURCES = [
    _plain_source("smddprun"),
    _torchrun,
    _plain_source("openmpi"),
    _plain_source("mpich"),
    _slurm,
    _plain_source("horovod"),
    _sagemaker,
]


def _validate(f: _Found) -> None:
    if f.size < 1:
        raise DiscoveryError(f"{f.size_var}={f.size} ({f.launcher}): the world size must be at least 1")
    if not 0 <= f.rank < f.size:
        raise DiscoveryError(
            f"{f.rank_var}={f.rank} is outside [0, {f.size_var}={f.size}) ({f.launcher})")
    if f.local_size == -1:
        return
    if f.local_size < 1:
        raise DiscoveryError(
            f"{f.local_size_var}={f.local_size} ({f.launcher}): the local size must be at least 1")
    if f.local_size > f.size:
        raise DiscoveryError(
            f"{f.local_size_var}={f.local_size} exceeds {f.size_var}={f.size} ({f.launcher})")
    if not 0 <= f.local_rank < f.local_size:
        raise DiscoveryError(
            f"{f.local_rank_var}={f.local_rank} is outside "
            f"[0, {f.local_size_var}={f.local_size}) ({f.launcher})")


def _cross_check(chosen: _Found, others: list[_Found]) -> None:
    """Every other launcher's variables must agree with the chosen one's.

    The exception is an enclosing launcher: `srun` or `mpirun` starting one
    torchrun per node leaves its own, smaller world in the environment. A world
    smaller than the chosen one is taken to be such. SageMaker's host list is not
    per-process information and is never compared.
    """
    for other in others:
        if other.launcher == "sagemaker" or other.size < chosen.size:
            continue
        if other.size != chosen.size:
            raise DiscoveryError(
                f"{chosen.size_var}={chosen.size} ({chosen.launcher}) disagrees with "
                f"{other.size_var}={other.size} ({other.launcher}); unset the stale variables")
        if other.rank != chosen.rank:
            raise DiscoveryError(
                f"{chosen.rank_var}={chosen.rank} ({chosen.launcher}) disagrees with "
                f"{other.rank_var}={other.rank} ({other.launcher}); unset the stale variables")


def _job_id(env, launcher: str) -> str | None:
    for names in _JOB_ID_VARS.get(launcher, []):
        values = [_get(env, n) for n in names]
        if all(v is not None for v in values):
            return "|".join(f"{n}={v}" for n, v in zip(names, values))
    return None


def _port(env, name: str, value: str, offset: int = 0) -> int:
    port = _int(env, name) + offset
    if not 0 < port < 65536:
        where = f" (the store listens on {name}+{offset})" if offset else ""
        raise DiscoveryError(f"{name}={value!r} does not give a TCP port in 1-65535{where}")
    return port


def _store_addr(env, found: _Found) -> tuple[str, bool]:
    """The store address, and whether it is only the loopback default."""
    for name in ("SMDDP_STORE_ADDR", "MASTER_ADDR"):
        value = _get(env, name)
        if value is not None:
            return value, False
    if found.launcher == "sagemaker":
        # Rank 0 is the first host of the list.
        return _sagemaker_hosts(env)[0], False
    return _DEFAULT_STORE_ADDR, True


def _store_port(env, found: _Found, job_id: str | None) -> int:
    value = _get(env, "SMDDP_STORE_PORT")
    if value is not None:
        return _port(env, "SMDDP_STORE_PORT", value)
    value = _get(env, "MASTER_PORT")
    if value is not None:
        # MASTER_PORT is torch's own store; ours listens on the next port.
        return _port(env, "MASTER_PORT", value, offset=1)
    if found.size == 1:
        return 0
    if job_id is None:
        raise DiscoveryError(
            f"a world of {found.size} ranks ({found.launcher}) needs a rendezvous port that all "
            "ranks agree on, and nothing in the environment identifies the job to derive one: "
            "set MASTER_ADDR and MASTER_PORT (or SMDDP_STORE_ADDR and SMDDP_STORE_PORT) to the "
            "same values on every rank")
    return _PORT_BASE + zlib.crc32(job_id.encode()) % _PORT_SPAN


def _secret(env, found: _Found, job_id: str | None, addr: str, port: int) -> str:
    global _warned_derived_secret
    value = _get(env, "SMDDP_SECRET")
    if value is not None:
        return value
    if found.size == 1:
        return ""
    if not _warned_derived_secret:
        _warned_derived_secret = True
        warnings.warn(
            "SMDDP_SECRET is not set: connections between ranks are authenticated only by a "
            "secret derived from the job id and the store address, which anyone who can see "
            "those can compute. smddprun sets a random one; with other launchers export "
            "SMDDP_SECRET with the same random value on every rank.",
            stacklevel=3)
    material = f"{job_id or ''}|{addr}|{port}"
    return hashlib.sha256(material.encode()).hexdigest()


def discover(env: Mapping[str, str] | None = None) -> WorldInfo:
    """Describe this process's place in the job; `env` defaults to os.environ."""
    if env is None:
        env = os.environ
    present = [f for f in (read(env) for read in _SOURCES) if f is not None]
    if present:
        found, others = present[0], present[1:]
    else:
        # A plain `python script.py`.
        found = _Found("single", 0, 1, 0, 1, "", "", "", "")
        others = []
    _validate(found)
    _cross_check(found, others)

    addr, addr_is_default = _store_addr(env, found)
    multi_host = found.local_size != -1 and found.local_size < found.size
    if found.size > 1 and multi_host and addr_is_default:
        raise DiscoveryError(
            f"{found.local_size_var}={found.local_size} < {found.size_var}={found.size} "
            f"({found.launcher}): the job spans several hosts, but no store address is set and "
            f"{_DEFAULT_STORE_ADDR} reaches only this one. Set MASTER_ADDR (or SMDDP_STORE_ADDR) "
            "to the host of rank 0 on every rank")
    job_id = _job_id(env, found.launcher)
    port = _store_port(env, found, job_id)
    secret = _secret(env, found, job_id, addr, port)

    host = _get(env, "SMDDP_HOST")
    if host is None:
        host = _get(env, "SM_CURRENT_HOST") if found.launcher == "sagemaker" else None
    if host is None:
        host = socket.gethostname()

    return WorldInfo(rank=found.rank, size=found.size, local_rank=found.local_rank,
                     local_size=found.local_size, host=host, store_addr=addr,
                     store_port=port, secret=secret, launcher=found.launcher)


def export_original_environment(world: WorldInfo, environ=None) -> None:
    """Sets the variables the original library's launcher exported, which clients read
    (Hugging Face transformers takes its device from SMDATAPARALLEL_LOCAL_RANK when SageMaker's
    data-parallel switch is on), unless they are set already."""
    env = os.environ if environ is None else environ
    values = {
        "SMDATAPARALLEL_RANK": world.rank,
        "SMDATAPARALLEL_SIZE": world.size,
        "SMDATAPARALLEL_SERVER_ADDR": env.get("MASTER_ADDR") or world.store_addr or "127.0.0.1",
        "SMDATAPARALLEL_SERVER_PORT": env.get("MASTER_PORT") or world.store_port,
    }
    if world.local_rank >= 0:
        values.update(SMDATAPARALLEL_LOCAL_RANK=world.local_rank, SMDATAPARALLEL_LOCAL_SIZE=world.local_size)
    for key, value in values.items():
        if value is not None and value != "":
            env.setdefault(key, str(value))
