"""The model-parallel configuration: the original library's keys, defaults and checks.

SageMaker passes the estimator's `parameters` as JSON in SM_HP_MP_PARAMETERS; those values are
merged over the dict given to smp.init (the environment wins), as the original does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

ENV_PARAMETERS = "SM_HP_MP_PARAMETERS"

# key -> (default, meaning). "partitions" has no default: the degree must be chosen.
KEYS: Dict[str, tuple] = {
    "partitions": (None, "pipeline-parallel degree: how many ranks hold one model replica"),
    "microbatches": (1, "microbatches each smp.step batch is split into"),
    "pipeline": ("interleaved", '"simple" (all forwards, then all backwards) or "interleaved" '
                                "(a microbatch's backward as soon as it can)"),
    "optimize": ("speed", '"speed" or "memory": sets the default memory_weight'),
    "memory_weight": (None, "weight of memory against compute in the auto-partition cost "
                            "(0.2 with optimize=speed, 0.8 with optimize=memory)"),
    "placement_strategy": ("cluster", '"cluster": one replica on consecutive ranks; '
                                      '"spread": pipeline ranks a dp-group apart'),
    "auto_partition": (True, "partition by traced cost; False: smp.partition contexts"),
    "default_partition": (None, "partition of modules outside smp.partition (manual mode)"),
    "ddp": (False, "data parallelism across model replicas (needed when size > partitions)"),
    "active_microbatches": (None, "microbatches in flight at once (default partitions + 2)"),
    "deterministic_server": (False, "accepted for compatibility: execution order is always "
                                    "by microbatch priority here"),
    "tensor_parallel_degree": (1, "only 1 is supported"),
    "horovod": (False, "only False is supported (the TensorFlow-Horovod mode of the original)"),
    "fp16": (False, "only False is supported (see HALF_PRECISION_INSTEAD)"),
    "bf16": (False, "only False is supported (see HALF_PRECISION_INSTEAD)"),
}
# What to use instead of the later v1 releases' half-precision modes.
HALF_PRECISION_INSTEAD = {
    "fp16": "train in half precision with torch.autocast inside the smp.step function and smp.amp.GradScaler",
    "bf16": "train in bfloat16 with torch.autocast inside the smp.step function, or cast the model with "
            "model.to(torch.bfloat16)",
}
ALIASES = {"pipeline_parallel_degree": "partitions"}


class ConfigError(ValueError):
    pass


@dataclass
class Config:
    partitions: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    optimize: str = "speed"
    memory_weight: float = 0.2
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: Optional[int] = None
    ddp: bool = False
    active_microbatches: int = 0
    deterministic_server: bool = False
    tensor_parallel_degree: int = 1
    horovod: bool = False
    fp16: bool = False
    bf16: bool = False
    source: Dict[str, Any] = field(default_factory=dict)


def _from_environment(environ) -> Dict[str, Any]:
    text = environ.get(ENV_PARAMETERS, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"smp.init: {ENV_PARAMETERS} is not valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"smp.init: {ENV_PARAMETERS} must hold a JSON object, got {type(value).__name__}")
    return value


def _canonical(raw: Dict[str, Any], where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name not in KEYS:
            known = ", ".join(sorted([*KEYS, *ALIASES]))
            raise ConfigError(f"smp.init: unknown configuration key {key!r} in {where} (known: {known})")
        if name in out and out[name] != value:
            raise ConfigError(f"smp.init: {where} sets both 'partitions' and 'pipeline_parallel_degree'")
        out[name] = value
    return out


def _int(cfg: Dict[str, Any], name: str, low: int) -> None:
    v = cfg[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"smp.init: {name!r} must be an integer >= {low}, got {v!r}")


def _bool(cfg: Dict[str, Any], name: str) -> None:
    if not isinstance(cfg[name], bool):
        raise ConfigError(f"smp.init: {name!r} must be true or false, got {cfg[name]!r}")


def _choice(cfg: Dict[str, Any], name: str, allowed) -> None:
    if cfg[name] not in allowed:
        raise ConfigError(f"smp.init: {name!r} must be one of {', '.join(map(repr, allowed))}, got {cfg[name]!r}")


def resolve(config: Optional[Dict[str, Any]], world_size: int, environ=None) -> Config:
    """The merged, checked configuration. Raises ConfigError naming the key at fault; every
    rank reads the same inputs, so every rank raises the same error before any communication."""
    environ = os.environ if environ is None else environ
    if config is not None and not isinstance(config, dict):
        raise ConfigError(f"smp.init(config): expected a dict, got {type(config).__name__}")
    merged = _canonical(dict(config or {}), "the smp.init dict")
    merged.update(_canonical(_from_environment(environ), ENV_PARAMETERS))
    source = dict(merged)
    if merged.get("partitions") is None:
        raise ConfigError("smp.init: 'partitions' (the pipeline-parallel degree) is required: pass "
                          f"smp.init({{'partitions': N, ...}}) or set it in {ENV_PARAMETERS}")
    cfg = {k: d for k, (d, _) in KEYS.items()}
    cfg.update(merged)
    _int(cfg, "partitions", 1)
    _int(cfg, "microbatches", 1)
    _choice(cfg, "pipeline", ("simple", "interleaved"))
    _choice(cfg, "optimize", ("speed", "memory"))
    _choice(cfg, "placement_strategy", ("cluster", "spread"))
    for name in ("auto_partition", "ddp", "deterministic_server", "horovod", "fp16", "bf16"):
        _bool(cfg, name)
    if cfg["memory_weight"] is None:
        cfg["memory_weight"] = 0.8 if cfg["optimize"] == "memory" else 0.2
    w = cfg["memory_weight"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
        raise ConfigError(f"smp.init: 'memory_weight' must be a number in [0, 1], got {w!r}")
    cfg["memory_weight"] = float(w)
    if cfg["active_microbatches"] is None:
        cfg["active_microbatches"] = cfg["partitions"] + 2
    _int(cfg, "active_microbatches", 1)
    if cfg["tensor_parallel_degree"] != 1:
        raise ConfigError("smp.init: 'tensor_parallel_degree' other than 1 is not supported by this "
                          "implementation (pipeline and data parallelism are)")
    if cfg["horovod"]:
        raise ConfigError("smp.init: 'horovod': true (the original's TensorFlow mode) is not supported "
                          "by the PyTorch package")
    for name, instead in HALF_PRECISION_INSTEAD.items():
        if cfg[name]:
            raise ConfigError(f"smp.init: {name!r}: true is not supported by this implementation; {instead}")
    p = cfg["partitions"]
    if cfg["auto_partition"] is False:
        if cfg["default_partition"] is None:
            raise ConfigError("smp.init: 'auto_partition': false needs 'default_partition' (the "
                              "partition of modules created outside smp.partition)")
    if cfg["default_partition"] is not None:
        _int(cfg, "default_partition", 0)
        if cfg["default_partition"] >= p:
            raise ConfigError(f"smp.init: 'default_partition' is {cfg['default_partition']}, but there are "
                              f"only {p} partitions (0..{p - 1})")
    if world_size % p != 0:
        raise ConfigError(f"smp.init: the world size {world_size} is not divisible by 'partitions' = {p}")
    if world_size > p and not cfg["ddp"]:
        raise ConfigError(f"smp.init: {world_size} processes for {p} partitions make "
                          f"{world_size // p} model replicas, which needs 'ddp': true (otherwise the "
                          "replicas would train apart)")
    return Config(source=source, **cfg)
