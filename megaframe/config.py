"""Typed configuration: one dataclass per config group, the Hydra schema, and cross-field checks.

The YAML files under conf/ are merged onto these dataclasses, so a typo'd key or a wrong type is an
error at composition time. `load_config` composes, converts to the dataclass tree, and runs
`validate`, which knows the world size and refuses a layout before any process group exists.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
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
    vocab_size: int = 4096
    """Rows of the embedding table; >= the tokenizer's vocabulary, divisible by parallel.tp."""
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
    compile: bool = False
    """torch.compile each transformer block (the first steps pay the compile time; the losses stay equal
    up to float rounding). Works on CPU (inductor's C++ backend) and CUDA."""
    recompute: str = "none"
    """Activation recompute: none | selective (recompute the attention core, SDPA, in backward: Megatron's
    selective mode, it saves the S x S-sized intermediates) | full (torch.utils.checkpoint per block: only
    each block's input is kept). Trades compute for activation memory; losses are unchanged."""


@dataclass
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
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
    """Hold out this fraction of each dataset's tokens (its tail, cut on a document boundary) for
    validation (train.eval_interval); the training samples never include them."""
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
    # `checkpoint.async` is the user-facing name, but `async` is a Python keyword: declare the field
    # through the class namespace; code reads it as `cfg.checkpoint.async_save`.
    __annotations__["async"] = bool
    locals()["async"] = field(default=False, init=False, repr=False, compare=False)  # kept out of generated code
    """Copy to host, write in a background thread and commit at a later step boundary."""

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
    """MEGAFRAME_RUN_NAME, else torchrun's run id (stable across its restarts), else a timestamp.

    Ranks may disagree on a timestamp; the trainer broadcasts rank 0's run dir after init.
    """
    import time

    name = os.environ.get("MEGAFRAME_RUN_NAME") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if name and name != "none":
        return name
    return time.strftime("%Y%m%d-%H%M%S")


def load_config(overrides: list[str], world_size: Optional[int] = None, check_data: bool = True) -> Config:
    """Compose conf/config.yaml with Hydra overrides, convert to `Config`, validate. Raises ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=list(overrides))
        cfg = OmegaConf.to_object(raw)
    except (OmegaConfBaseException, Exception) as e:  # Hydra wraps most errors; keep one line
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(_one_line(e)) from e
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


def _req(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config, world_size: int, check_data: bool = True) -> None:
    """Cross-field checks that need no process group; the first problem raises ConfigError."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("tp", "pp", "vpp", "ep"):
        _req(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be >= 1")
    _req(world_size % (p.tp * p.pp) == 0,
         f"parallel.tp={p.tp} x parallel.pp={p.pp} does not divide the world size {world_size}")
    dp = world_size // (p.tp * p.pp)
    _req(m.hidden_size % m.num_attention_heads == 0,
         f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    _req(m.num_attention_heads % m.kv_heads == 0,
         f"model.num_query_groups={m.kv_heads} does not divide model.num_attention_heads={m.num_attention_heads}")
    _req(m.num_attention_heads % p.tp == 0,
         f"parallel.tp={p.tp} does not divide model.num_attention_heads={m.num_attention_heads}")
    _req(m.kv_heads % p.tp == 0, f"parallel.tp={p.tp} does not divide model.num_query_groups={m.kv_heads}")
    _req(m.ffn_hidden_size % p.tp == 0, f"parallel.tp={p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
    _req(m.vocab_size % p.tp == 0, f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size}")
    _req(m.head_dim % 2 == 0 or m.position_embedding != "rope", "model head dim must be even for RoPE")
    _req(m.norm in ("rmsnorm", "layernorm"), f"model.norm={m.norm!r} must be rmsnorm or layernorm")
    _req(m.activation in ("swiglu", "gelu"), f"model.activation={m.activation!r} must be swiglu or gelu")
    _req(m.position_embedding in ("rope", "learned"),
         f"model.position_embedding={m.position_embedding!r} must be rope or learned")
    _req(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    if p.sp:
        _req(m.seq_length % p.tp == 0, f"parallel.sp needs parallel.tp={p.tp} to divide model.seq_length={m.seq_length}")
    _check_moe(m, p, dp)
    _req(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    _req(t.global_batch_size % (t.micro_batch_size * dp) == 0,
         f"train.global_batch_size={t.global_batch_size} is not divisible by "
         f"train.micro_batch_size={t.micro_batch_size} x dp={dp}")
    _check_pipeline(cfg, dp)
    _req(t.max_steps >= 1, f"train.max_steps={t.max_steps} must be >= 1")
    _req(t.log_interval >= 1, f"train.log_interval={t.log_interval} must be >= 1")
    _req(t.hang_timeout_s >= 0, f"train.hang_timeout_s={t.hang_timeout_s} must be >= 0 (0 = no watchdog)")
    _req(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r} must be auto, cpu or cuda")
    _req(cfg.optim.lr > 0 and cfg.optim.min_lr >= 0, "optim.lr must be > 0 and optim.min_lr >= 0")
    _req(cfg.optim.warmup_steps >= 0, f"optim.warmup_steps={cfg.optim.warmup_steps} must be >= 0")
    _req(cfg.optim.zero in (0, 1), f"optim.zero={cfg.optim.zero} must be 0 or 1")
    _req(cfg.optim.bucket_size_mb > 0, f"optim.bucket_size_mb={cfg.optim.bucket_size_mb} must be > 0")
    _req(t.recompute in ("none", "selective", "full"),
         f"train.recompute={t.recompute!r} must be none, selective or full")
    _req(t.precision in ("fp32", "bf16"), f"train.precision={t.precision!r} must be fp32 or bf16")
    _req(t.precision == "fp32" or cfg.optim.zero == 1,
         f"train.precision={t.precision} needs optim.zero=1 (its fp32 master weights live in the ZeRO optimizer)")
    _req(cfg.logging.wandb.mode in ("online", "offline", "disabled"),
         f"logging.wandb.mode={cfg.logging.wandb.mode!r} must be online, offline or disabled")
    _req(cfg.data.kind in ("prepared", "synthetic"), f"data.kind={cfg.data.kind!r} must be prepared or synthetic")
    _check_data_fields(cfg)
    r = cfg.checkpoint.resume
    _req(r in ("auto", "none") or (Path(r) / "metadata.json").is_file(),
         f"checkpoint.resume={r}: not a committed checkpoint folder (no metadata.json)")
    if r not in ("auto", "none"):
        from megaframe.checkpoint.sharded import verify
        try:
            verify(r)
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume={r}: {e}") from e
    if check_data and cfg.data.kind == "prepared":
        _check_prepared(cfg)


def _check_moe(m: ModelConfig, p: ParallelConfig, dp: int) -> None:
    _req(m.num_experts >= 0, f"model.num_experts={m.num_experts} must be >= 0")
    _req(p.ep == 1 or m.num_experts > 0, f"parallel.ep={p.ep} needs model.num_experts > 0 (a MoE model)")
    _req(dp % p.ep == 0, f"parallel.ep={p.ep} does not divide the data-parallel size {dp} (ep ranks come from dp)")
    if m.num_experts == 0:
        return
    _req(m.num_experts % p.ep == 0, f"parallel.ep={p.ep} does not divide model.num_experts={m.num_experts}")
    _req(1 <= m.moe_top_k <= m.num_experts,
         f"model.moe_top_k={m.moe_top_k} must be in [1, model.num_experts={m.num_experts}]")
    _req(m.activation == "swiglu", f"model.activation={m.activation!r}: MoE experts are SwiGLU only")
    _req(m.moe_router_score in ("softmax", "sigmoid"),
         f"model.moe_router_score={m.moe_router_score!r} must be softmax or sigmoid")
    _req(m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1,
         f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} must be >= 1 (or null)")
    _req(m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
         f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (or null for dropless)")
    _req(m.moe_aux_loss_coeff >= 0 and m.moe_z_loss_coeff >= 0,
         "model.moe_aux_loss_coeff and model.moe_z_loss_coeff must be >= 0")


def _check_pipeline(cfg: Config, dp: int) -> None:
    from megaframe.pipeline.partition import stage_counts
    from megaframe.pipeline.schedule import check_args, resolve_kind

    p, t = cfg.parallel, cfg.train
    _req(p.vpp == 1 or p.pp > 1, f"parallel.vpp={p.vpp} needs parallel.pp > 1")
    _req(p.pp_schedule in ("auto", "gpipe", "1f1b", "interleaved"),
         f"parallel.pp_schedule={p.pp_schedule!r} must be auto, gpipe, 1f1b or interleaved")
    try:
        stage_counts(cfg.model.num_layers, p.pp, p.vpp, p.pp_layout)
        check_args(resolve_kind(p.pp_schedule, p.vpp), p.pp, p.vpp, t.global_batch_size // (t.micro_batch_size * dp))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _check_data_fields(cfg: Config) -> None:
    d, t = cfg.data, cfg.train
    _req(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0 (0 = every core)")
    _req(d.tokenizer_sample_bytes >= 0, f"data.tokenizer_sample_bytes={d.tokenizer_sample_bytes} must be >= 0")
    _req(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    for i, b in enumerate(d.blend):
        _req(bool(b.path) and b.weight > 0, f"data.blend[{i}] needs a path and a weight > 0")
    _req(t.eval_interval >= 0 and t.eval_iters >= 1,
         f"train.eval_interval={t.eval_interval} must be >= 0 and train.eval_iters={t.eval_iters} >= 1")
    _req(t.eval_interval == 0 or d.kind == "synthetic" or d.valid_fraction > 0,
         f"train.eval_interval={t.eval_interval} needs a validation split: set data.valid_fraction > 0")


def _check_prepared(cfg: Config) -> None:
    """Every prepared dataset (data.path, or each data.blend path) is whole and fits the model."""
    from megaframe.data.shards import check_datasets

    try:
        check_datasets(cfg)
    except ValueError as e:
        raise ConfigError(_one_line(e)) from e
