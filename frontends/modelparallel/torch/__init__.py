"""smdistributed.modelparallel.torch: pipeline-parallel training of any torch module.

    import smdistributed.modelparallel.torch as smp
    smp.init({"partitions": 2, "microbatches": 4})
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target)
        model.backward(loss)
        return output, loss

Runs on the smddp process groups (CPU engine and NCCL) under smddprun, torchrun, mpirun or srun.
"""
from .comm import (CommGroup, RankType, allgather, barrier, broadcast, dp_barrier, dp_rank, dp_size,  # noqa: F401
                   get_dp_group, get_dp_process_group, get_mp_group, get_mp_process_group, get_pp_group,
                   get_pp_process_group, get_rdp_group, get_rdp_process_group, get_tp_group,
                   get_world_process_group, local_rank, local_size, mp_barrier, mp_rank, mp_size, pp_barrier,
                   pp_rank, pp_size, rank, rdp_rank, rdp_size, recv_from, send, size, tp_rank, tp_size)
from . import amp, nn, optimizers  # noqa: F401 (smp.amp.GradScaler, smp.nn.FusedLayerNorm, smp.optimizers.FusedLamb)
# The checkpoint submodule first: importing it binds the package attribute `checkpoint` to the
# module, and smp.checkpoint must be the activation-checkpointing function.
from .checkpoint import load, resume_from_checkpoint, save, save_checkpoint  # noqa: F401
from .activation_checkpointing import checkpoint, checkpoint_sequential, set_activation_checkpointing  # noqa: F401
from .config import ConfigError  # noqa: F401
from .model import DistributedModel  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .partition import partition  # noqa: F401
from .runtime import StepFailed  # noqa: F401
from .state import init as _init, state as _state
from .step import StepOutput, step  # noqa: F401

WORLD = CommGroup.WORLD
MP_GROUP = CommGroup.MP_GROUP
DP_GROUP = CommGroup.DP_GROUP
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP


def init(config=None) -> None:
    """Reads the configuration (the dict, then SM_HP_MP_PARAMETERS over it), starts
    torch.distributed on smddp if needed, and makes the pipeline and data-parallel groups."""
    _init(config)


def is_initialized() -> bool:
    return _state.initialized


def is_tracing() -> bool:
    return _state.tracing


# Tensor parallelism, the original's smp.nn.Distributed* modules and smp.tensor_parallelism, is
# not part of this library: say so by name rather than with a bare AttributeError.
_TENSOR_PARALLEL = {"tensor_parallelism", "delay_param_initialization", "set_tensor_parallelism"}


def __getattr__(name: str):
    if name in _TENSOR_PARALLEL:
        raise nn.tensor_parallelism_unsupported(f"smp.{name}")
    raise AttributeError(f"module 'smdistributed.modelparallel.torch' has no attribute '{name}'")
