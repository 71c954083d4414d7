"""Per-rank memory of a layout, computed in one process from the config alone.

For every (pipeline rank, tensor rank) coordinate the planner builds that rank's exact model on the
meta device with a virtual mesh (no process groups; megaframe.parallel.virtual), then counts:

  params       every local parameter in train.precision (what mem/params_bytes logs)
  grads        optim.zero=1: the fp32 grad buffer, padded bucket by bucket by the optimizer's own
               buffer code (optim/sizing.py planned_memory_bytes); zero=0: one grad per parameter
               zero=2: only the owned 1/dp of it (plus a tied embedding's bucket, kept whole for the step);
               HSDP (optim.shard_group_size=s): 1/s instead of 1/dp; 2 bytes an element instead of 4 under
               optim.grad_reduce_dtype=bf16 (and half the reduce-scatter / all-reduce bytes in dp bytes)
  optim        optim.zero>=1: the owned 1/dp (HSDP: 1/s) of every bucket x (two fp32 Adam moments, plus
               an fp32 master copy for bf16 params); zero=0: two fp32 moments per element
  dp bytes     ZeRO: the bytes a rank sends on dp per step (optim/sizing.py planned_dp_bytes, the same
               buckets);
               zero=3: params are the owned 1/dp (fp32 master), every param sharded
  activations  the bytes one micro-batch of each pipeline chunk saves for backward (a meta-device
               forward, planning.memory.activations), times the chunks in flight at the schedule's peak:
               the rank's own action list (pipeline/schedule.py) walked forward by forward; under
               cp the forward runs on the rank's S/cp tokens with attention over a virtual cp axis
               (the gathered K/V, or the ring's own block), plus, with attention dropout, the cp causal bias
               the layers share; under data.document_mask what the documents add (plan_documents)
  cp bytes     the bytes a rank sends on cp per step (comm_bytes/cp): context.cp_bytes_per_layer, the
               theory the cp byte-count test checks, times the rank's layers and micro-batches

dp and cp ranks of one coordinate hold the same amounts (ZeRO pads every bucket to a multiple of cp·dp;
every cp rank holds two equal chunks), so each coordinate is sized once (at cp rank 0); rows with equal
figures are merged when printed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from megaframe.config.derived import derive
from megaframe.config.schema import Config
from megaframe.model.parallelize import build_model_for, rank_stage
from megaframe.optim.rule_registry import rule_named
from megaframe.parallel.virtual import virtual_mesh
from megaframe.pipeline.schedule import W, compute_order, schedule_spec, splits_backward
from megaframe.planning.memory.activations import chunk_activation_bytes, w_fraction
from megaframe.planning.memory.block_memory import gpu_kernels, plan_documents, working_set_bytes
from megaframe.planning.memory.block_memory import on_host as _on_host
from megaframe.planning.memory.inflight import peak_activations
from megaframe.planning.memory.phases import host_peaks, phase_peaks, step_terms, today_load, today_startup
from megaframe.planning.memory.rank_state import (
    cp_bias_bytes,
    cp_step_bytes,
    dp_comm_bytes,
    grads_fp32_bytes,
    optim_bytes_by_dp_rank,
    rank_shape,
    state_bytes,
)
from megaframe.planning.steptime.timing import _bubble, split_costs


@dataclass
class RankFigures:
    """Memory of the ranks at one (pp_rank, tp_rank) coordinate (all of its dp ranks)."""

    pp_rank: int
    tp_rank: int
    ranks: list[int]
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    chunk_activation_bytes: list[int]
    """Per micro-batch, per pipeline chunk of this rank."""
    peak_inflight: int
    """Micro-batch chunks whose activations are held at once, at the activation peak."""
    activation_bytes: int
    """Peak over the schedule of the activations held."""
    total_bytes: int = 0
    fits: bool | None = None
    dp_comm_bytes: int | None = None
    """Bytes each of these ranks sends on dp per step (comm_bytes/dp) under ZeRO; None for zero=0."""
    cp_comm_bytes: int = 0
    """Bytes each of these ranks sends on cp per step (comm_bytes/cp); 0 without context parallelism."""
    grads_fp32_bytes: int = 0
    """optim.grad_reduce_dtype=bf16: the fp32 copy of the owned reduced grads the update reads
    (mem/grads_fp32_bytes). It lives from the reduction to the next step's zero_grad, after the last
    backward has freed the activations, so the peak holds the larger of the two, not both."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak bytes of start-up, the step, a save and a resume's load (memory.phases)."""
    today_startup_bytes: int = 0
    """Start-up as it was before meta-device init (the whole local model in fp32), for comparison."""
    today_load_bytes: int = 0
    """A resume's load as it was before shard-wise reads (full local-shape tensors), for comparison."""
    step_terms: dict[str, int] = field(default_factory=dict)
    """The step phase's peak as named terms (memory.phases.step_terms; they sum to phases["step"])."""
    host_bytes: dict[str, int] = field(default_factory=dict)
    """Host memory a save (its copy of what the rank writes) and a load (the staging buffer) add."""

    @property
    def peak_bytes(self) -> int:
        """The largest phase (the step's total when the phases were not modelled)."""
        return max([self.total_bytes, *self.phases.values()])

    def __post_init__(self):
        self.total_bytes = (
            self.params_bytes
            + self.grads_bytes
            + self.optim_bytes
            + max(self.activation_bytes, self.grads_fp32_bytes)
        )

    def key(self) -> tuple:
        return (
            self.pp_rank,
            self.params_bytes,
            self.grads_bytes,
            self.optim_bytes,
            self.activation_bytes,
            tuple(self.chunk_activation_bytes),
            self.peak_inflight,
            self.dp_comm_bytes,
            self.cp_comm_bytes,
        )


@dataclass
class Plan:
    world_size: int
    layout: dict
    microbatches: int
    schedule: str
    bubble: float
    """Idle / makespan of the step from the schedule simulation (equal F and B times; zero-bubble kinds
    with F, B, W costs from the backward's split, planning.steptime.timing.split_costs)."""
    ranks: list[RankFigures] = field(default_factory=list)
    device_memory_bytes: int | None = None
    headroom: float = 0.0
    """The allocator's reserve over the allocated peak a rank must leave (Device.alloc_headroom): a rank
    fits when its largest phase x (1 + headroom), what torch.cuda.max_memory_reserved reads, is within the
    device's memory."""

    def needs(self, nbytes: int) -> int:
        """The device memory `nbytes` allocated take with the allocator's headroom."""
        return int(nbytes * (1 + self.headroom))

    @property
    def fits(self) -> bool | None:
        if self.device_memory_bytes is None:
            return None
        return all(r.fits for r in self.ranks)

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def plan_layout(
    cfg: Config, world_size: int, device_memory_gb: float | None = None, headroom: float = 0.0
) -> Plan:
    """Size every rank of the (validated) config on `world_size` ranks; `headroom`: Plan.headroom."""
    p, t = cfg.parallel, cfg.train
    tp, pp, cp = p.tp, p.pp, p.cp
    derived = derive(cfg, world_size)  # cp ranks read the same samples: dp alone divides the micro-batches
    dp, m, kind = derived.dp, derived.micro_batches, derived.pp_schedule
    plan = Plan(
        world_size,
        {
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "vpp": p.vpp,
            "sp": p.sp,
            "zero": cfg.optim.zero,
            "precision": t.precision,
            "micro_batch_size": t.micro_batch_size,
            "cp": cp,
            "grad_reduce_dtype": str(cfg.optim.grad_reduce_dtype),
            "cp_comm": str(getattr(p.cp_comm, "value", p.cp_comm)),
        },
        m,
        kind,
        _bubble(kind, pp, p.vpp, m, split_costs(cfg, t.recompute) if splits_backward(kind) else None),
    )
    plan.headroom = headroom
    if device_memory_gb is not None:
        plan.device_memory_bytes = int(device_memory_gb * 2**30)  # GiB, as torch.cuda reports
    cache: dict = {}
    for pp_rank in range(pp):
        order = compute_order(kind, pp, p.vpp, m, pp_rank)
        # each tp rank is sized from its own model (or one of the same shape); the dp ranks
        # of a coordinate hold the same (module doc): sized once
        for tp_rank in range(tp):
            plan.ranks.append(_rank_figures(cfg, tp, pp, dp, pp_rank, tp_rank, order, cache))
    for r in plan.ranks:
        cap = plan.device_memory_bytes
        r.fits = None if cap is None else plan.needs(r.peak_bytes) <= cap
    return plan


def _rank_figures(
    cfg: Config, tp: int, pp: int, dp: int, pp_rank: int, tp_rank: int, order, cache: dict | None = None
) -> RankFigures:
    mesh = virtual_mesh(
        tp,
        pp,
        dp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        device="meta",
        ep=cfg.parallel.ep,
        etp=cfg.parallel.etp,
        shard=cfg.optim.shard_group_size,
        cp=cfg.parallel.cp,
    )
    # what the rank's model decides is the same on every rank of the same shape: the stage's chunk sizes,
    # whether it holds the embedding / head, and a tp rank at an edge (a padded vocab slice) or inside;
    # blocks are equal in size, so a 126-layer pp16 tp8 plan builds 3 x 3 models, not 128
    spec = schedule_spec(cfg.parallel.pp_schedule, cfg.parallel.vpp)
    stage = rank_stage(cfg.model, cfg.parallel, mesh, spec)
    key = (tuple(len(c) for c in stage.chunks), stage.first, stage.last, min(tp_rank, 1), tp_rank == tp - 1)
    if cache is None or key not in cache:
        found = _model_figures(cfg, mesh, dp, any(a.kind == W for a in order), (tp_rank, pp_rank))
        if cache is not None:
            cache[key] = found
    else:
        found = cache[key]
    model_part, chunks, keep, extra, shape, working = found
    act, inflight = peak_activations(order, chunks, keep)
    # replace() re-runs __post_init__: the activations go in with it (total_bytes is their sum)
    out = replace(
        model_part,
        pp_rank=pp_rank,
        tp_rank=tp_rank,
        ranks=list(mesh.dpcp.ranks),
        peak_inflight=inflight,
        activation_bytes=act + extra,
    )
    params, grads, optim = out.params_bytes, out.grads_bytes, out.optim_bytes
    out.phases = phase_peaks(
        shape, params, grads, optim, out.activation_bytes + working, on_host=_on_host(cfg)
    )
    out.step_terms = step_terms(shape, params, grads, optim, out.activation_bytes + working)
    out.host_bytes = host_peaks(shape, optim)
    out.today_startup_bytes = today_startup(shape, params, grads, optim)
    out.today_load_bytes = today_load(
        shape, params + grads + optim, cfg.optim.zero == 3 or cfg.train.precision != "fp32"
    )
    return out


def _model_figures(cfg: Config, mesh, dp: int, split: bool, coord: tuple[int, int]) -> tuple:
    """What the rank's own model decides: its state and comm bytes (a RankFigures with no schedule yet),
    activations per chunk, the share a pending W keeps, the cp bias, the phases' shape, the working set.
    `coord`: the (tp, pp) rank it is built for (every rank of its shape holds the same)."""
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    if cfg.data.document_mask:
        plan_documents(model, cfg)
    params, grads, optim = state_bytes(model, cfg, mesh)
    if cfg.optim.zero and rule_named(cfg.optim.name).kinds is not None:
        # a rule keeping other state on hidden matrices than on the rest holds different bytes on each dp
        # rank (whose owned ranges hold other params): the coordinate's most
        optim = max(optim_bytes_by_dp_rank(model, cfg, coord[0], coord[1], dp))
    # fused: real devices run a fused attention kernel; meta's math path would count the S x S matrix; a GPU
    # also runs RMSNorm's fused kernel (a CPU run the composite, which the CPU measurements hold it to)
    mb = cfg.train.micro_batch_size
    chunks = [
        chunk_activation_bytes(model, c, mb, True, cfg.train.compile, gpu_kernels(cfg))
        for c in range(len(model.stage.chunks))
    ]
    # a split backward's pending W keeps the weighted ops' inputs and output grads (memory.activations)
    keep = [int(b * w_fraction(model, c, mb)) for c, b in enumerate(chunks)] if split else None
    out = RankFigures(
        0,
        0,
        [],
        params,
        grads,
        optim,
        chunks,
        0,
        0,
        cp_comm_bytes=cp_step_bytes(cfg, model, dp),
        grads_fp32_bytes=grads_fp32_bytes(model, cfg, mesh),
    )
    out.dp_comm_bytes = dp_comm_bytes(model, cfg, mesh, dp)
    working = working_set_bytes(
        cfg,
        mesh.tp.size,
        cfg.parallel.cp,
        str(getattr(cfg.train.recompute, "value", cfg.train.recompute)),
        mb,
    )
    return out, chunks, keep, cp_bias_bytes(model), rank_shape(model, cfg, mesh), working


def merged_rows(plan: Plan) -> list[tuple[list[int], RankFigures]]:
    """Rows of equal figures within a pipeline rank merged: ([tp ranks], figures with all their ranks)."""
    rows: dict[tuple, tuple[list[int], RankFigures]] = {}
    for r in plan.ranks:
        if r.key() in rows:
            tps, first = rows[r.key()]
            tps.append(r.tp_rank)
            # a copy was stored (below): merging never changes the plan's own rows
            first.ranks = sorted(first.ranks + r.ranks)
        else:
            rows[r.key()] = ([r.tp_rank], RankFigures(**{**asdict(r), "ranks": list(r.ranks)}))
    return list(rows.values())
