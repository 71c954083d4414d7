"""Typed configuration: one dataclass per config group, the Hydra schema, and cross-field checks.

The YAML files under conf/ are merged onto these dataclasses, so a typo'd key or a wrong type is an
error at composition time. `load_config` composes, converts to the dataclass tree, and runs
`validate` (the checks are in config_checks.py), which knows the world size and refuses a layout
before any process group exists.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"


class ConfigError(ValueError):
    """A bad setting; the message names the field. Entry points turn it into exit code 2."""


@dataclass
class ModelConfig:
    name: str = "gpt_tiny"
    """Preset name, for logs only."""
    num_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 128
    """Model width D."""
    num_attention_heads: int = 4
    """Query heads; must divide by parallel.tp."""
    num_query_groups: Optional[int] = None
    """Key/value heads for GQA; None means num_attention_heads (plain multi-head attention)."""
    ffn_hidden_size: int = 512
    """MLP inner width F (per branch for SwiGLU)."""
    seq_length: int = 128
    """Tokens per sample."""
    vocab_size: Optional[int] = None
    """Rows of the embedding table; >= the tokenizer's vocabulary, divisible by parallel.tp. None = the
    prepared data's vocabulary (data.path's meta.json, else data.vocab_size), padded up to a multiple of
    megaframe.config_keys.VOCAB_PAD (the same for every layout, so layouts stay comparable)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 means a dense MLP."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of each expert's SwiGLU (per branch); None means ffn_hidden_size."""
    moe_router_score: str = "softmax"
    """softmax | sigmoid: how router logits become scores (top-k weights are renormalised to sum 1)."""
    moe_aux_loss_coeff: float = 0.01
    """Load-balancing loss (Switch/GShard: E * sum_e f_e * P_e) weight; logged as aux_loss."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss (mean squared logsumexp of the logits) weight; logged as z_loss."""
    moe_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only,
    moved after each step by moe_bias_update_rate towards under-loaded experts (a checkpointed buffer)."""
    moe_bias_update_rate: float = 1e-3
    """Step of the expert-bias update: bias_e += rate * sign(mean load - load_e), then recentred."""
    moe_capacity_factor: Optional[float] = None
    """None = dropless. Else each expert takes at most ceil(factor * tokens * top_k / experts) assignments
    of a micro-batch (first come, in token order); the rest are dropped (moe/layer{i}/dropped_frac)."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (0 keeps layouts bit-comparable)."""
    norm: str = "rmsnorm"
    """rmsnorm | layernorm."""
    activation: str = "swiglu"
    """swiglu | gelu."""
    position_embedding: str = "rope"
    """rope | learned."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    bias: bool = False
    """Biases on linear layers (GPT-2 style)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * num_layers)."""

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn(self) -> int:
        """Inner width of one expert (moe_ffn_hidden_size, else ffn_hidden_size)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


class CPComm(str, Enum):
    """How context-parallel ranks see each other's keys and values (megaframe/parallel/context.py)."""
    allgather = "allgather"
    ring = "ring"


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (innermost, fastest-varying rank axis)."""
    pp: int = 1
    """Pipeline-parallel size (outermost axis)."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank; 1 = plain 1F1B."""
    ep: int = 1
    """Expert-parallel size, borrowed from the data-parallel ranks."""
    sp: bool = False
    """Sequence parallelism: split the sequence over tp between blocks (needs tp > 1 to matter)."""
    pp_schedule: str = "auto"
    """gpipe | 1f1b | interleaved | auto (interleaved when vpp > 1, else 1f1b)."""
    pp_layout: Optional[list[int]] = None
    """Layers per virtual stage (pp x vpp entries, stage s = chunk * pp + rank) for uneven splits."""
    # -- context parallelism (megaframe/parallel/context.py)
    cp: int = 1
    """Context-parallel size: each sequence cut into 2·cp chunks, cp rank i keeps chunks i and 2cp-1-i
    (rank order: between tp and dp). Parameters are replicated over cp; grads reduced over cp·dp."""
    cp_comm: CPComm = CPComm.allgather
    """allgather: K and V all-gathered over cp before attention (grads reduce-scattered in backward);
    ring: K/V blocks passed around the cp ring (not implemented yet: refused)."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks."""
    max_steps: int = 300
    """Optimizer steps to run."""
    seed: int = 1234
    """Seeds init (with each parameter's global name) and the sample order."""
    log_interval: int = 25
    """Write metrics every this many steps (and at the last step)."""
    max_bad_steps: int = 10
    """Stop with an error after this many optimizer steps in a row with a non-finite grad norm (each is skipped)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    precision: str = "fp32"
    """fp32 | bf16: bf16 parameters and compute, with fp32 master weights, Adam moments and grad
    reduction in the optimizer (needs optim.zero=1). No loss scaling: bf16 has fp32's range."""
    eval_interval: int = 0
    """Compute val_loss on the validation split every this many steps (and at the last); 0 = never."""
    eval_iters: int = 4
    """Global batches of validation samples per evaluation (the same fixed samples every time)."""
    hang_timeout_s: float = 600.0
    """Hang watchdog: a rank making no step progress for this many seconds writes its Python stacks
    and last collectives to stderr and ${run.dir}/hang/rank{R}.txt, then exits with code 124; 0 = off."""
    dist_timeout_s: float = 600.0
    """Process-group timeout: a collective waiting longer fails the run (NCCL: its watchdog aborts the
    communicator and dumps the flight recorder). Checkpoint saves get checkpoint.save_timeout_s."""
    signal_check_interval: int = 10
    """Every this many steps (and at the first, log and last steps) the ranks agree, in one host-side
    all-reduce, whether a stop signal arrived and whether an async checkpoint's writers are done; no
    collective over the whole job in the other steps. A signal stops the run within this many steps."""
    compile: bool = False
    """torch.compile each transformer block (the first steps pay the compile time; the losses stay equal
    up to float rounding). Works on CPU (inductor's C++ backend) and CUDA."""
    recompute: str = "none"
    """Activation recompute: none | selective (recompute the attention core, SDPA, in backward: Megatron's
    selective mode, it saves the S x S-sized intermediates) | full (torch.utils.checkpoint per block: only
    each block's input is kept). Trades compute for activation memory; losses are unchanged."""
    # -- samples during training (megaframe.inference.sampler)
    sample_interval: int = 0
    """Every this many steps, write greedy continuations of sample_prompts to the console, ${run.dir}/samples.jsonl
    and wandb (a table); 0 = never. Needs prepared data (its tokenizer). Time excluded from tokens_per_s."""
    sample_prompts: list[str] = field(default_factory=lambda: ["The", "Once upon a time"])
    """Prompts of the training-time samples."""
    sample_tokens: int = 24
    """New tokens per training-time sample."""


class LRSchedule(str, Enum):
    """Shape of the learning rate after warmup (megaframe/optim/schedule.py has the formulas)."""
    cosine = "cosine"
    linear = "linear"
    wsd = "wsd"
    constant = "constant"


@dataclass
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay (kept past the decay horizon)."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    lr_schedule: LRSchedule = LRSchedule.cosine
    """cosine | linear | wsd (warmup-stable-decay) | constant: the decay after warmup."""
    lr_decay_steps: Optional[int] = None
    """Decay horizon in steps (from step 0): min_lr is reached here and kept after. None = train.max_steps of
    the run's first start; a resume adopts the horizon its checkpoint recorded, so a larger max_steps
    continues at min_lr instead of reshaping the curve."""
    wsd_decay_fraction: float = 0.2
    """wsd only: the last fraction of the horizon over which lr decays linearly to min_lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay; applied to matrices only, never to norms or biases."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    zero: int = 1
    """1: ZeRO-1 distributed optimizer (AdamW state sharded over dp, grads reduce-scattered in buckets
    during backward, params all-gathered after the step; with one dp rank and fp32 params there is nothing to shard,
    so the replicated optimizer runs instead).
    0: replicated AdamW with a plain all-reduce of grads after backward (for comparison)."""
    bucket_size_mb: float = 25.0
    """ZeRO grad bucket size in MiB of fp32 grads: one reduce-scatter per bucket, launched as soon as
    backward has finished all of its grads. Smaller buckets start earlier but cost more launches."""


@dataclass
class BlendSource:
    path: str = ""
    """A folder written by megaframe.data.prepare."""
    weight: float = 1.0
    """Relative share of the training samples (weights are normalized)."""


class DocSplit(str, Enum):
    """How a plain-text file becomes documents (jsonl / json / parquet: one document per record)."""
    file = "file"
    paragraph = "paragraph"


DEFAULT_EXTENSIONS = [
    # records
    ".jsonl", ".json", ".parquet",
    # prose and markup
    ".txt", ".md", ".markdown", ".rst", ".tex", ".org", ".adoc", ".html", ".htm", ".xml", ".csv", ".tsv",
    # source code and its configuration
    ".py", ".pyi", ".ipynb", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".cuh", ".java", ".kt",
    ".scala", ".go", ".rs", ".rb", ".php", ".js", ".jsx", ".mjs", ".ts", ".tsx", ".swift", ".m", ".mm", ".cs",
    ".fs", ".hs", ".ml", ".lua", ".pl", ".r", ".jl", ".dart", ".zig", ".nim", ".ex", ".exs", ".erl", ".clj",
    ".el", ".vim", ".sh", ".bash", ".zsh", ".ps1", ".sql", ".css", ".scss", ".yaml", ".yml", ".toml", ".ini",
    ".cfg", ".proto", ".cmake", ".mk", ".gradle", ".bzl",
]
"""data.extensions' default. Any of them may also be gzipped (name.ext.gz)."""


@dataclass
class DataConfig:
    name: str = "demo"
    """Dataset label for logs."""
    kind: str = "prepared"
    """prepared (token shards under data.path) | synthetic (deterministic random tokens)."""
    path: str = ""
    """Folder written by megaframe.data.prepare: tokenizer.model, meta.json and token shards."""
    source: str = ""
    """For prepare: a folder or glob of .txt, .jsonl(.gz) or .parquet files."""
    vocab_size: int = 4096
    """For prepare: sentencepiece vocabulary size to train."""
    text_key: str = "text"
    """For prepare: the text field of jsonl / parquet records."""
    tokenizer: str = ""
    """For prepare: reuse this tokenizer (a sentencepiece .model or a transformers tokenizer folder)
    instead of training one; empty = train a sentencepiece BPE of data.vocab_size pieces."""
    tokenizer_sample_bytes: int = 1 << 30
    """For prepare: train the tokenizer on about this many bytes of text spread over the corpus (0 = all)."""
    num_workers: int = 0
    """For prepare: tokenizer processes; 0 = one per CPU core."""
    valid_fraction: float = 0.0
    """Hold out about this fraction of each dataset's tokens for validation (train.eval_interval): whole
    documents in a fixed seeded random order (megaframe.data.dataset.VALID_SEED); training never reads them."""
    extensions: list[str] = field(default_factory=lambda: list(DEFAULT_EXTENSIONS))
    """For prepare: the file name endings read from a data.source folder or glob (.jsonl/.json/.parquet as
    records, the rest as plain text); files without any extension are read when their head is text."""
    split: DocSplit = DocSplit.file
    """For prepare: file = one document per text file (code, web pages); paragraph = one document per
    blank-line separated paragraph (books). jsonl / json / parquet are always one document per record."""
    blend: list[BlendSource] = field(default_factory=list)
    """Train on several prepared datasets mixed by weight, instead of data.path, e.g.
    data.blend='[{path: /data/a, weight: 0.7}, {path: /data/b, weight: 0.3}]'. They must share a tokenizer."""


@dataclass
class CheckpointConfig:
    dir: str = "${run.dir}/checkpoints"
    """Where step_XXXXXXXX/ folders and the `latest` pointer live."""
    interval: int = 0
    """Save every this many steps; 0 saves only at the end."""
    resume: str = "auto"
    """auto (newest committed in dir, if any) | none | a step folder path."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints (0 keeps all)."""
    on_save_error: str = "stop"
    """stop | continue: when a save is not committed (a rank's write failed, or its pieces do not cover
    every tensor exactly once), stop the run with exit 1, or warn and go on (the next save tries again).
    Either way nothing is committed and `latest` and older checkpoints stay as they were."""
    # `checkpoint.async` is the user-facing name, but `async` is a Python keyword: declare the field
    # through the class namespace; code reads it as `cfg.checkpoint.async_save`.
    __annotations__["async"] = bool
    locals()["async"] = field(default=False, init=False, repr=False, compare=False)  # kept out of generated code
    """Copy to host, write in a background thread and commit at a later step boundary."""
    save_timeout_s: float = 1800.0
    """The allowance of a checkpoint save or load, used twice: the hang watchdog's limit while one runs
    (train.hang_timeout_s covers steps only: a save is slow, not hung), and the timeout of the world group
    whose barriers and metadata gathers wait for the slowest writer (a large synchronous save may
    outlast train.dist_timeout_s). Must be > 0."""

    # --- safety (issue 20): resume checks and the save watchdog ---
    allow_config_change: list[str] = field(default_factory=list)
    """Fields a resume may change from the checkpoint's config, e.g. [train.global_batch_size] (the data
    then continues from the saved consumed samples), [train.seed], [model.dropout] or [model] (all of
    model.*). Anything else that differs is refused (exit 2): it would skip or repeat data or change the model."""
    # --- end safety ---

    @property
    def async_save(self) -> bool:
        return getattr(self, "async")


@dataclass
class WandbConfig:
    mode: str = "offline"
    """online | offline | disabled."""
    project: str = "megaframe"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team); None uses the default."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RunConfig:
    name: str = "dev"
    """Run name; the wandb id and default run dir derive from it."""
    dir: str = "outputs/${run.name}"
    """Output folder shared by every rank: metrics.jsonl, config.yaml, checkpoints."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="megaframe_schema", node=Config)
    if not OmegaConf.has_resolver("mf_root"):
        OmegaConf.register_new_resolver("mf_root", lambda: str(ROOT))
    if not OmegaConf.has_resolver("mf_run_name"):
        OmegaConf.register_new_resolver("mf_run_name", default_run_name)


def default_run_name() -> str:
    """MEGAFRAME_RUN_NAME, else torchrun's run id (stable across its restarts), else a unique timestamp.

    Ranks may disagree on a timestamp; the trainer broadcasts rank 0's run dir after init.
    """
    import time

    name = os.environ.get("MEGAFRAME_RUN_NAME") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if name and name != "none":
        return name
    # two jobs started in the same second must not share a run dir: milliseconds, then the Slurm job id
    # (unique per job) or a random suffix
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    job = os.environ.get("SLURM_JOB_ID")
    return f"{stamp}-{f'job{job}' if job else os.urandom(3).hex()}"


def load_config(overrides: list[str], world_size: Optional[int] = None, check_data: bool = True) -> Config:
    """Compose conf/config.yaml with Hydra overrides, convert to `Config`, validate. Raises ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register()
    from megaframe.config_keys import check_override_keys

    check_override_keys(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=list(overrides))
        cfg = OmegaConf.to_object(raw)
    except (OmegaConfBaseException, Exception) as e:  # Hydra wraps most errors; keep one line
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(_one_line(e)) from e
    # settings from outside the command line: the resumed checkpoint's model, WANDB_MODE (before validate,
    # so every check, the resume checks included, sees the values the run will use)
    from megaframe.checkpoint.adopt import adopt_model, apply_environment

    adopt_model(cfg, list(overrides))
    apply_environment(cfg, list(overrides))
    if world_size is None:  # torchrun's WORLD_SIZE, else srun's task count (one Slurm task = one rank)
        world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    validate(cfg, world_size,
             check_data=check_data)
    return cfg


def _one_line(e: BaseException) -> str:
    """The error and its cause (Hydra puts the reason, e.g. a failed type conversion, in __cause__)."""
    parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ is not None and str(e.__cause__) not in str(e) else [])
    words = " ".join(" ".join(p.split()) for p in parts)
    words = words.split(" full_key:")[0]  # OmegaConf appends a multi-field context block
    return words or type(e).__name__


def validate(cfg: Config, world_size: int, check_data: bool = True) -> None:
    """Cross-field checks that need no process group; the first problem raises ConfigError.
    The checks themselves live in megaframe/config_checks.py. Fills model.vocab_size when unset."""
    from megaframe.config_checks import check_config

    if cfg.model.vocab_size is None:
        from megaframe.config_keys import default_vocab_size

        cfg.model.vocab_size = default_vocab_size(cfg)

    check_config(cfg, world_size, check_data)
