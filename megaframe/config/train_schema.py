"""The train group of the schema (re-exported by schema.py, where the groups meet in Config): batch
sizes and steps, precision and recompute, the intervals of evaluation, sampling and scoring, the run's
timeouts. A leaf like schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megaframe.config.choices import Device, Fp8Recipe, Precision, Recompute
from megaframe.config.frozen import Frozen


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
