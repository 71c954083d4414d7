"""The config schema: one dataclass per config group (a docstring per field; the model, data, train and
optim groups are in model_schema.py, data_schema.py, train_schema.py and optim_schema.py, re-exported
here); its closed string choices are the Enums of megaframe/config/choices.py. Hydra merges conf/*.yaml onto
these, so a typo'd key, a wrong type or a value outside an Enum is an error at composition time. A leaf
module (of megaframe it imports only the schema's other modules and errors.py): model, optim, checkpoint
and the checks all read it; loading and validation (megaframe.config) sit above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional, get_type_hints

from megaframe.config.choices import (  # noqa: F401  (re-exported: the schema's public names)
    Activation,
    CPComm,
    DataKind,
    Device,
    DocSplit,
    EPDispatch,
    Fp8Recipe,
    GradReduceDtype,
    LRSchedule,
    MuonAdjustLR,
    Norm,
    PositionEmbedding,
    Precision,
    Recompute,
    RopeType,
    RouterScore,
    SaveErrorPolicy,
    ScheduleKind,
    StateDtype,
    StepKernel,
    WandbMode,
)
from megaframe.config.data_schema import (  # noqa: F401  (the data group)
    DEFAULT_EXTENSIONS,
    BlendSource,
    DataConfig,
    DataStage,
)
from megaframe.config.frozen import Frozen
from megaframe.config.model_schema import ModelConfig, RopeScalingConfig  # noqa: F401  (the model group)
from megaframe.config.optim_schema import MuonConfig, OptimConfig  # noqa: F401  (the optim group)
from megaframe.config.train_schema import TrainConfig  # noqa: F401  (the train group)
from megaframe.errors import ConfigError  # noqa: F401  (re-exported: the schema's error type)

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"


def enum_fields(cls: type) -> dict[str, type[Enum]]:
    """The Enum-typed fields of a schema dataclass, name -> Enum (to type values set after composition)."""
    return {k: t for k, t in get_type_hints(cls).items() if isinstance(t, type) and issubclass(t, Enum)}


@dataclass
class ParallelConfig(Frozen):
    tp: int = 1
    """Tensor-parallel size (innermost, fastest-varying rank axis)."""
    pp: int = 1
    """Pipeline-parallel size (outermost axis)."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank; 1 = plain 1F1B."""
    ep: int = 1
    """Expert-parallel size, folded over tp x cp x dp as Megatron folds it (docs/moe.md, "Layout"):
    ep x etp must divide tp x cp x dp; the experts' data-parallel size is tp·cp·dp / (ep·etp)."""
    etp: int = 1
    """Experts' own tensor-parallel size (Megatron's --expert-tensor-parallel-size): each expert's weights
    split over etp ranks of the folded expert grid, independent of tp."""
    ep_dispatch: EPDispatch = EPDispatch.all_to_all
    """all_to_all: one all-to-all over the ep group, a row per (token, expert) | node: a token crosses to
    another node once for all its experts there, then reaches them inside the node (DeepEP's and
    HybridEP's way; docs/moe.md "Dispatch by node"). Equal results to float noise; dropless experts and
    etp = 1 only. Where the ep group lies in one node both are the same all-to-all."""
    ranks_per_node: int = 0
    """Ranks on one node, for parallel.ep_dispatch=node; 0: the launcher's (torchrun's LOCAL_WORLD_SIZE,
    srun's tasks per node). Set it to emulate nodes on one machine; the planner takes its +device's."""
    sp: bool = False
    """Sequence parallelism: split the sequence over tp between blocks (needs tp > 1 to matter)."""
    tp_comm_overlap: bool = False
    """Under sp at tp > 1: cut the all-gather before each column-parallel GEMM and the reduce-scatter after
    each row-parallel one into chunks pipelined with the partial GEMMs (Megatron's and torchtitan's
    collective matmul; layers/tp_overlap.py). Equal results; not applied to FP8 linears."""
    tp_comm_chunks: int = 4
    """Chunks of the local sequence block under tp_comm_overlap (the largest count <= this dividing it)."""
    pp_schedule: ScheduleKind = ScheduleKind.auto
    """gpipe | 1f1b | interleaved | zb_h1 | zbv | auto (interleaved when vpp > 1, else 1f1b). zb_h1 (vpp=1)
    and zbv (vpp=2, chunks in a V: rank 0 holds both ends) are the zero-bubble schedules: each backward is
    split into B (input gradient) and W (weight gradients, deferred into the bubble); not with train.compile
    or train.precision=fp8."""
    pp_layout: Optional[list[int]] = None
    """Layers per virtual stage (pp x vpp entries, stage s = chunk * pp + rank) for uneven splits."""
    # -- context parallelism (megaframe/parallel/context.py)
    cp: int = 1
    """Context-parallel size: each sequence cut into 2·cp chunks, cp rank i keeps chunks i and 2cp-1-i
    (rank order: between tp and dp). Parameters are replicated over cp; grads reduced over cp·dp."""
    cp_comm: CPComm = CPComm.allgather
    """allgather: K and V all-gathered over cp before attention (grads reduce-scattered in backward);
    ring: K/V blocks passed around the cp ring with p2p, partial results merged by log-sum-exp."""


@dataclass
class CheckpointConfig(Frozen):
    dir: str = "${run.dir}/checkpoints"
    """Where step_XXXXXXXX/ folders and the `latest` pointer live."""
    interval: int = 0
    """Save every this many steps; 0 saves only at the end (and on a stop signal)."""
    interval_minutes: float = 0.0
    """Also save once this many minutes of wall time have passed since this run's start or its last save;
    0 = off. The ranks agree at the stop-check steps (train.signal_check_interval), so a save comes at
    most that many steps late and no extra collective runs: a node that dies without a signal loses at
    most this much time. Use with checkpoint.interval for long jobs (scripts/slurm/pretrain.sbatch)."""
    resume: str = "auto"
    """auto (this run's newest committed checkpoint in dir, if any: its `latest`) | none | a step folder path
    | a checkpoint dir (the checkpoint its `latest` names; the way to continue a folder another run wrote)."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints (0 keeps all)."""
    on_save_error: SaveErrorPolicy = SaveErrorPolicy.stop
    """stop | continue: when a save is not committed (a rank's write failed, or its pieces do not cover
    every tensor exactly once), stop the run with exit 1, or warn and go on (the next save tries again).
    Either way nothing is committed and `latest` and older checkpoints stay as they were."""
    # `checkpoint.async` is the user-facing name, but `async` is a Python keyword: declare the field
    # through the class namespace; code reads it as `cfg.checkpoint.async_save`.
    __annotations__["async"] = bool
    # kept out of generated code
    locals()["async"] = field(default=False, init=False, repr=False, compare=False)
    """Copy to host, write in a background thread and commit at a later step boundary."""
    save_timeout_s: float = 1800.0
    """The allowance of a checkpoint save or load, used twice: the hang watchdog's limit while one runs
    (train.hang_timeout_s covers steps only: a save is slow, not hung), and the timeout of the world group
    whose barriers and metadata gathers wait for the slowest writer (a large synchronous save may
    outlast train.dist_timeout_s). Must be > 0."""

    # --- safety: resume checks and the save watchdog ---
    allow_config_change: list[str] = field(default_factory=list)
    """Fields a resume may change from the checkpoint's config, e.g. [train.global_batch_size] (the data
    then continues from the saved consumed samples), [train.seed], [model.dropout], [model] (all of
    model.*), [data.stages], [data.blend], [data.path], [data.valid_fraction] or [data] (what the run trains
    on, from the checkpoint's data record). Anything else that differs is refused (exit 2): it would skip or
    repeat data or change the model."""
    # --- end safety ---

    @property
    def async_save(self) -> bool:
        return getattr(self, "async")


@dataclass
class WandbConfig(Frozen):
    mode: WandbMode = WandbMode.offline
    """online | offline | disabled."""
    project: str = "megaframe"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team); None uses the default."""


@dataclass
class TensorboardConfig(Frozen):
    enabled: bool = False
    """Also write every scalar of metrics.jsonl as TensorBoard events (logging rank only), the step as the
    global step. Needs the tensorboard package (a dependency of megaframe)."""
    dir: str = "${run.dir}/tensorboard"
    """Event folder (`tensorboard --logdir` it). Every start of the run adds an event file to it: one
    TensorBoard run whose steps continue; a resume hides the steps an earlier start logged after the
    checkpoint it resumes from."""


@dataclass
class LoggingConfig(Frozen):
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)


@dataclass
class RunConfig(Frozen):
    name: str = "dev"
    """Run name, one per start; the default run dir derives from it (the wandb id from the run dir's
    recorded identity, megaframe.run_id)."""
    dir: str = "outputs/${run.name}"
    """Output folder shared by every rank: metrics.jsonl, config.yaml, checkpoints."""


@dataclass
class Config(Frozen):
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)


def plain(cfg) -> dict:
    """dataclasses.asdict with every Enum as its plain string value: what checkpoint metadata, wandb and
    metadata JSON record (they must read back without this module)."""
    import dataclasses

    return dataclasses.asdict(
        cfg, dict_factory=lambda kv: {k: v.value if isinstance(v, Enum) else v for k, v in kv}
    )
