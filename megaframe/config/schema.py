"""The config schema: one dataclass per config group (a docstring per field; the model group is in
model_schema.py and the data group in data_schema.py, both re-exported here); its closed string choices
are the Enums of megaframe/config/choices.py. Hydra merges conf/*.yaml onto these, so a typo'd key, a wrong
type or a value outside an Enum is an error at composition time. A leaf module (of megaframe it imports only
config/choices.py and errors.py):
model, optim, checkpoint and the checks all read it; loading and validation (megaframe.config) sit above.
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
class TrainConfig(Frozen):
    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks."""
    max_steps: int = 300
    """Optimizer steps to run."""
    seed: int = 1234
    """Seeds init (with each parameter's global name) and the sample order."""
    log_interval: int = 25
    """Write metrics every this many steps (and at the first and last steps: step 1 shows the run is alive
    and gives the first ETA)."""
    threads: Optional[int] = None
    """CPU threads per rank (torch.set_num_threads at start-up, shown in the header). null: OMP_NUM_THREADS
    where the environment sets it (torchrun sets 1 per worker), else the cores this process may use divided
    by the ranks on this node (LOCAL_WORLD_SIZE), at least 1. On a shared machine fewer threads are often
    faster: threads that wait on each other at every op lose to one that runs. At most 4 per CPU of the
    machine (os.cpu_count(); more is refused, exit 2); above its CPU count a warning at start-up."""
    max_bad_steps: int = 10
    """Stop with an error after this many optimizer steps in
    a row with a non-finite grad norm (each is skipped)."""
    device: Device = Device.auto
    """auto | cpu | cuda."""
    precision: Precision = Precision.fp32
    """fp32 | bf16 | fp8: bf16 parameters and compute, with fp32 master weights, Adam moments and grad
    reduction in the optimizer (needs optim.zero=1). No loss scaling: bf16 has fp32's range. fp8 is bf16
    with the transformer blocks' linears as float8 GEMMs through torchao (the head too under train.fp8_head;
    needs torchao; fast only with train.compile=true on an H100-class GPU); the embedding lookup, router and
    experts stay bf16, and an fp8 checkpoint is a bf16 one. Under optim.zero=3 with the tensorwise recipe the
    float8 linears' weights are all-gathered as float8 (1 byte per element instead of 2)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """tensorwise | rowwise: torchao's float8 scaling under train.precision=fp8 (one scale per tensor, or
    per row of each GEMM operand: slower, closer to bf16)."""
    fp8_head: bool = False
    """Under train.precision=fp8, true runs the output head's GEMMs (logits and both backward GEMMs, inside
    the fused head + cross-entropy's chunks) float8 too, where its local weight dims (vocab shard, hidden) are
    multiples of 16. Off by default, as torchtitan and Megatron keep the head bf16: its casts run outside the
    compiled blocks, over the V-wide logits' grad, and cost more than its float8 GEMMs save."""
    eval_interval: int = 0
    """Compute val_loss on the validation split every this many steps (and at the last); 0 = never."""
    eval_iters: int = 4
    """Global batches of validation samples per evaluation (the same fixed samples every time)."""
    hang_timeout_s: float = 600.0
    """Hang watchdog: a rank making no progress for this many seconds writes its Python stacks
    and last collectives to stderr and ${run.dir}/hang/rank{R}.txt, then exits with code 124; 0 = off.
    Progress is a step, and between steps each batch of validation, each sampled token and each batch of
    downstream scoring; a save has checkpoint.save_timeout_s, lm-eval's own work around the scoring
    train.downstream_harness_timeout_s."""
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
    compile_timeout_s: float = 1800.0
    """Under train.compile=true, the first step's limit instead of train.dist_timeout_s (every mesh
    group's collectives) and train.hang_timeout_s: with pp, stage k's first receives wait while stages
    0..k-1 compile one after the other. Must be > 0."""
    fused_head_loss: bool = True
    """At tp=1, the head and the cross-entropy run fused in chunks of tokens (layers/fused_ce.py): the
    [tokens, V] logits never exist whole. false: the head writes the whole logits and the loss takes their
    fp32 log-softmax (as torchtitan and most trainers run it): more memory, the same losses up to float
    rounding. Under tp > 1 the vocab-parallel loss always holds the logits of this rank's vocabulary slice."""
    recompute: Recompute = Recompute.none
    """Activation recompute: none | selective (recompute the attention core, SDPA, in backward: Megatron's
    selective mode, it saves the S x S-sized intermediates) | full (torch.utils.checkpoint per block: only
    each block's input is kept) | op_selective (torch's selective activation checkpointing per block,
    torchtitan's op-level policy: keeps the attention kernels' outputs and every other matmul's, re-runs
    the rest; not with the zb_h1 / zbv schedules). Trades compute for activation memory; losses are
    unchanged."""
    # -- samples during training (megaframe.inference.sampler)
    sample_interval: int = 0
    """Every this many steps, write greedy continuations of sample_prompts to the console,
    ${run.dir}/samples.jsonl and wandb (a table); 0 = never. Needs prepared data (its tokenizer). Time
    excluded from tokens_per_s."""
    sample_prompts: list[str] = field(default_factory=lambda: ["The", "Once upon a time"])
    """Prompts of the training-time samples."""
    sample_tokens: int = 24
    """New tokens per training-time sample."""
    # -- downstream tasks during training (megaframe.evaluation.downstream; needs the extra .[eval])
    downstream_interval: int = 0
    """Every this many steps (and at the last), score train.downstream_tasks with lm-evaluation-harness on the
    live model under the run's layout; logs downstream/<task>/<metric> to metrics.jsonl and wandb; 0 = never.
    A task that fails logs one line and training goes on. Needs prepared data (its tokenizer); time excluded
    from tokens_per_s."""
    downstream_tasks: list[str] = field(default_factory=list)
    """lm-eval task names (hellaswag, arc_easy, or a local task under train.downstream_include_path)."""
    downstream_include_path: str = ""
    """A folder of lm-eval task YAMLs (local tasks, no network); empty: lm-eval's own tasks only."""
    downstream_limit: int = 0
    """Score only the first N documents of each task (a quick in-loop signal); 0 = every document."""
    downstream_batch_size: int = 8
    """Sequences per forward while scoring (each padded to model.seq_length)."""
    # -- where the time goes (training/profiling.py; docs/checkpoints.md#profiling)
    profile_steps: list[int] = field(default_factory=list)
    """Steps to profile with torch.profiler: each run of consecutive steps writes one Chrome/Perfetto trace
    per rank, ${run.dir}/profile/rank<R>_steps<A>-<B>.json.gz, with a named range for each pipeline action,
    collective and the optimizer step (`python -m megaframe.plot --trace`). Empty (default): no profiler,
    no range, nothing recorded."""
    memory_snapshot: list[int] = field(default_factory=list)
    """CUDA: record the allocator's history from the first of these steps on and write torch's memory
    snapshot after each of them, ${run.dir}/profile/memory_rank<R>_step<S>.pickle (pytorch.org/memory_viz).
    Ignored on CPU (one note). Empty (default): nothing recorded. Whatever it holds, a CUDA run that runs
    out of memory in a step writes memory_rank<R>_oom.pickle before it exits."""
    downstream_harness_timeout_s: float = 1800.0
    """The hang watchdog's limit for lm-eval's own work on a downstream task, outside the model's scoring
    calls (its task index, the dataset's download, building requests, metrics), where no batch runs to
    count as progress and no collective can hang. Inside the scoring calls each batch is progress, judged
    by train.hang_timeout_s like validation and sampling. Must be > 0."""


@dataclass
class MuonConfig(Frozen):
    """optim.name=muon: torch.optim.Muon's orthogonalised momentum on the 2-D hidden matrices (each fused
    QKV / gate-up block and each MoE expert its own matrix), AdamW (optim.beta1, beta2, eps) on the rest."""

    adamw_lr: Optional[float] = None
    """Peak lr of the AdamW part (embeddings, head, router, norms, biases), on optim.lr's schedule scaled by
    adamw_lr / optim.lr; None = optim.lr. The matrices take optim.lr and optim.weight_decay."""
    momentum: float = 0.95
    """Muon's momentum (torch.optim.Muon's default)."""
    nesterov: bool = True
    """Nesterov momentum: orthogonalise grad + momentum * buffer rather than the buffer."""
    ns_steps: int = 5
    """Newton-Schulz iterations of the orthogonalisation (coefficients 3.4445, -4.775, 2.0315)."""
    adjust_lr_fn: MuonAdjustLR = MuonAdjustLR.original
    """original | match_rms_adamw: the lr of an A x B matrix times sqrt(max(1, A / B)) (Keller Jordan's),
    or 0.2 * sqrt(max(A, B)) (Moonlight's, to reuse AdamW's lr and weight decay)."""


@dataclass
class OptimConfig(Frozen):
    name: str = "adamw"
    """The update rule (optim/rule_registry.py registers them): adamw (torch's fused AdamW; weight decay on
    matrices only) | muon (optim.muon: torch.optim.Muon's math on the hidden matrices, AdamW on the rest).
    Every rule runs under every optim.zero stage; a checkpoint's optimizer state is the rule's
    (optim/<state>/<param>)."""
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
    weight_decay: float = 0.1  # GPT-3 / Llama pretraining value
    """AdamW decoupled weight decay; applied to matrices only, never to norms or biases."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95  # not torch's 0.999: LLM pretraining's choice, steadier through loss spikes
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    zero: int = 1
    """1: ZeRO-1 distributed optimizer (AdamW state sharded over dp, grads reduce-scattered in buckets
    during backward, params all-gathered after the step; with one dp rank and fp32 params there is nothing to
    shard, so the replicated optimizer runs instead).
    2: ZeRO-2: as 1, and grads live only as this rank's 1/dp shard: each bucket is reduce-scattered into
    it as soon as backward completes it, in every micro-batch; no full-size grad buffer is kept.
    3: ZeRO-3: as 2, and params live as 1/dp shards too, each transformer block's gathered before its
    forward and its backward and freed after (with tp/sp, pp/vpp, ep, cp, HSDP and recompute; not yet
    compile).
    Under parallel.cp "dp" above is cp·dp: the cp ranks hold the same params, so ZeRO shards over all of them.
    0: replicated AdamW with a plain all-reduce of grads after backward (for comparison)."""
    reshard_after_forward: bool = True
    """zero=3: free a block's gathered params after its forward (and gather them again for its backward).
    false keeps them from the block's first forward of the step to its last backward: one gather per
    block per step instead of two per micro-batch, for the memory of the whole gathered chunk (the
    choice for pipelines, where several micro-batches are in flight)."""
    shard_group_size: int = 0
    """HSDP: shard grads and optimizer state over groups of this many consecutive dp ranks and replicate
    them across the dp / shard_group_size groups (their shards are all-reduced once per step). 0 = dp
    (plain ZeRO). Must divide dp; needs optim.zero >= 1. With experts (parallel.ep or etp > 1) the expert
    state keeps the same number of replicas r = dp / s, which must divide the experts' data-parallel size
    tp·cp·dp / (ep·etp) (docs/zero.md). Under parallel.cp = c the
    ranks cut into groups are the c·dp ranks sharing the params (cp inner): s a multiple of c shards over
    s/c whole cp groups and replicates over dp (Megatron/torchtitan's dp_shard·cp), s < c over part of a
    cp group; s must divide c·dp (0 = c·dp)."""
    overlap_param_gather: bool = True
    """ZeRO: the all-gather of updated parameters runs bucket by bucket during the next forward (each
    module's forward pre-hook waits for its bucket) instead of being waited for at the end of the step."""
    grad_reduce_dtype: GradReduceDtype = GradReduceDtype.fp32
    """fp32 | bf16 (Megatron's --grad-reduce-in-bf16, FSDP's reduce_dtype; needs train.precision=bf16): the
    dtype of the ZeRO grad buffers (zero=1: the whole buffer; zero=2/3: the owned shard and the bucket
    accumulators), of the grads' accumulation over micro-batches and of their reduce-scatter / all-reduce
    over dp. bf16 halves the grad memory and the grads' dp traffic. The reduced owned range is widened to
    fp32 once per step (a transient copy, 4 bytes per owned element, freed at the next zero_grad) for the
    clip, the norm and the AdamW step on the fp32 master weights (under optim.step_kernel=compiled not: the
    norm and the compiled pass read the bf16 grads as they are). Each rank's grads are already divided by
    the global token count before the reduction (the loss is), so the bf16 sum adds already-averaged
    values; only its rounding (~2^-8 relative per addition) differs from fp32."""
    state_dtype: StateDtype = StateDtype.fp32
    """fp32 | bf16: the dtype of the update rule's per-element state (AdamW's two moments), under every
    optim.zero stage; the fp32 master weights of bf16 params stay fp32 (torchtitan's bf16 optimizer states,
    Megatron's --use-precision-aware-optimizer). bf16 saves 4 of AdamW's 8 state bytes per element. The
    update itself runs in fp32 (the state widened per tensor, then rounded back). A checkpoint records
    the dtype of each state tensor; resuming into the other dtype converts it as it is read."""
    step_kernel: StepKernel = StepKernel.eager
    """eager | compiled: how AdamW's update (optim.name=adamw, and Muon's AdamW part) runs on each owned
    range. eager: torch's fused AdamW kernel on the fp32 master, which writes the clipped grad back, then a
    cast of the master into the bf16 params (42 bytes per parameter per step with fp32 state). compiled: one
    torch.compile'd pass per range that reads the grad once, updates the moments and the master and writes
    the bf16 parameter itself, the clip a scale inside it (34 bytes; 26 with optim.state_dtype=bf16;
    optim/adamw_fused.py). Inductor's C++ kernel on CPU, a Triton kernel on CUDA; the first step pays the
    compile (seconds), and a compile that fails falls back to the same math in eager ops with one warning.
    The losses stay equal up to float rounding."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """optim.name=muon's own settings."""
    bucket_size_mb: float = 25.0  # DDP's default bucket size
    """ZeRO grad bucket size in MiB of fp32 grads: one reduce-scatter per bucket, launched as soon as
    backward has finished all of its grads. Smaller buckets start earlier but cost more launches."""


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
