"""Typed configuration: compose conf/config.yaml with Hydra onto the schema (megaframe/config/schema.py),
adopt settings from outside the command line, and validate (the cross-field checks are in config/checks.py).

`load_config` knows the world size and refuses a layout before any process group exists. The schema's
names (Config, ModelConfig, ConfigError, ...) are re-exported here: `from megaframe.config import Config`
is the public path. Modules below the config loader (model, optim, checkpoint, checks) import
megaframe.config.schema instead, so nothing the loader imports imports it back.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
import socket
import time
from pathlib import Path
from typing import Optional

from megaframe.config.frozen import freeze
from megaframe.config.schema import (  # noqa: F401  (the public path of the schema's names)
    CONF_DIR,
    DEFAULT_EXTENSIONS,
    ROOT,
    Activation,
    BlendSource,
    CheckpointConfig,
    Config,
    CPComm,
    DataConfig,
    DataKind,
    Device,
    DocSplit,
    LoggingConfig,
    LRSchedule,
    ModelConfig,
    Norm,
    OptimConfig,
    ParallelConfig,
    PositionEmbedding,
    Precision,
    Recompute,
    RouterScore,
    RunConfig,
    SaveErrorPolicy,
    ScheduleKind,
    TrainConfig,
    WandbConfig,
    WandbMode,
    plain,
)
from megaframe.errors import ConfigError  # noqa: F401  (re-exported)
from megaframe.errors import one_line as _one_line


def _register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    # once per process: structuring the schema is ~40 ms of CPU, a quarter of a load, and every load (each
    # rank of each job of a tool or test) stored the same node again; Hydra deep-copies it on each read
    if "megaframe_schema.yaml" not in store.repo:
        store.store(name="megaframe_schema", node=Config)
    if not OmegaConf.has_resolver("mf_root"):
        OmegaConf.register_new_resolver("mf_root", lambda: str(ROOT))
    if not OmegaConf.has_resolver("mf_run_name"):
        # cached on the composed config: run.name, run.dir and checkpoint.dir each interpolate it, and
        # every call gives a new timestamp; one value per load is the run's one name (a second load, a
        # second start, gets its own)
        OmegaConf.register_new_resolver("mf_run_name", default_run_name, use_cache=True)


def default_run_name(env=None) -> str:
    """MEGAFRAME_RUN_NAME, else a name from torchrun's run (the same for all its workers and restarts),
    else a unique timestamp. Called once per load_config (the resolver is cached on the composed config).

    Ranks of a multi-node launch may disagree on a timestamp; the trainer broadcasts rank 0's name and
    folders after init, so every rank writes under one name.
    """
    env = os.environ if env is None else env
    name = env.get("MEGAFRAME_RUN_NAME", "")
    if name and name != "none":
        return name
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic:
        return torchrun_run_name(elastic) or elastic
    # two jobs started in the same second must not share a run dir: milliseconds, then the Slurm job id
    # (unique per job) or a random suffix
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    job = env.get("SLURM_JOB_ID")
    return f"{stamp}-{f'job{job}' if job else os.urandom(3).hex()}"


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def torchrun_run_name(run_id: str, agent_pid: int | None = None) -> str | None:
    """A readable name for torchrun's own run id: `--standalone` makes a UUID and a plain torchrun says
    "none". Both become the start time of the torchrun agent (this worker's parent, which outlives its
    workers' restarts) and a suffix from the id and the agent (two torchruns started in the same second
    differ). None for an id the user chose (`--rdzv-id=...`: used as it is) or when the agent's start
    time cannot be read (no /proc: then the id itself)."""
    if run_id != "none" and not _UUID.fullmatch(run_id):
        return None
    pid = os.getppid() if agent_pid is None else agent_pid
    started = process_start_time(pid)
    if started is None:
        return None
    tag = hashlib.sha256(f"{run_id}|{socket.gethostname()}|{pid}|{started}".encode()).hexdigest()[:6]
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(started)) + f"-{tag}"


def process_start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from /proc; None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    # field 22 (starttime, clock ticks since boot) counted after the command name's closing parenthesis
    fields = stat[stat.rindex(")") + 2 :].split()
    try:
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError, OSError):
        return None


def load_config(overrides: list[str], world_size: Optional[int] = None, check_data: bool = True) -> Config:
    """Compose conf/config.yaml with Hydra overrides, convert to `Config`, validate. Raises ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register()
    from megaframe.config.keys import check_override_keys

    check_override_keys(overrides)
    # Hydra keeps one global instance: a second load_config in a process (tests, tools) must start afresh
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=list(overrides))
        # to real dataclasses: enums typed, and every later access is a plain attribute, not OmegaConf's
        cfg = OmegaConf.to_object(raw)
    except (HydraException, OmegaConfBaseException) as e:  # a bad value, group or interpolation
        raise ConfigError(_composition_error(e)) from e
    # settings from outside the command line: the resumed checkpoint's model, WANDB_MODE (before validate,
    # so every check, the resume checks included, sees the values the run will use)
    from megaframe.config.adopt import adopt_model, apply_environment, resume_point

    cfg = apply_environment(adopt_model(resume_point(cfg), list(overrides)), list(overrides))
    if world_size is None:  # torchrun's WORLD_SIZE, else srun's task count (one Slurm task = one rank)
        world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if cfg.model.vocab_size is None:  # before the checks: they test divisibility of the vocabulary by tp
        from megaframe.config.keys import default_vocab_size

        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, vocab_size=default_vocab_size(cfg))
        )
    if cfg.model.family is None:  # a config or checkpoint from before model.family: the family it fits
        from megaframe.models.registry import with_family

        cfg = dataclasses.replace(cfg, model=with_family(cfg.model))
    validate(cfg, world_size, check_data=check_data)
    return freeze(cfg)  # every component reads these values as loaded (config/frozen.py)


def _composition_error(e: BaseException) -> str:
    """One line naming the field: OmegaConf keeps it in `full_key`, which the message of a value read
    from a YAML file (not an override, whose text names it) does not otherwise show."""
    line = _one_line(e).split(" Config search path:")[0]  # Hydra's search path: noise to a user
    missing = re.search(r"Could not find '(\w+)/([^']*)'\s*Available options in '\w+':\s*(.*)", line)
    if missing:  # an unknown preset (model=gpt2_tinyy): what was typed, the closest name, the choices
        group, typed, options = missing.group(1), missing.group(2), missing.group(3).split()
        close = difflib.get_close_matches(typed, options, n=1)
        return (
            f"{group}={typed}: no such {group} preset{f'; did you mean {close[0]}?' if close else ''} "
            f"(conf/{group}/: {', '.join(options)})"
        )
    key = next((getattr(x, "full_key", None) for x in (e, e.__cause__) if getattr(x, "full_key", None)), None)
    return line if not key or key in line else f"{key}: {line}"


def validate(cfg: Config, world_size: int, check_data: bool = True, schedules: bool = True) -> None:
    """Cross-field checks that need no process group; the first problem raises ConfigError.
    The checks themselves live in megaframe/config/checks.py. Fills model.vocab_size when unset (a config
    built by hand; load_config fills it on the copy it returns).
    `schedules=False` skips building every rank's pipeline schedule (the planner's search, over thousands)."""
    from megaframe.config.checks import check_config

    if cfg.model.vocab_size is None:
        from megaframe.config.keys import default_vocab_size

        # before the checks: they test divisibility of the vocabulary by tp
        cfg.model.vocab_size = default_vocab_size(cfg)

    check_config(cfg, world_size, check_data, schedules)
