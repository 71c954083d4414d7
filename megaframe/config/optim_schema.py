"""The optim group of the schema (re-exported by schema.py): the update rule and its lr curve, ZeRO
and HSDP, the state and grad-reduction dtypes, Muon's own settings. A leaf like schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megaframe.config.choices import GradReduceDtype, LRSchedule, MuonAdjustLR, StateDtype, StepKernel
from megaframe.config.frozen import Frozen


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
