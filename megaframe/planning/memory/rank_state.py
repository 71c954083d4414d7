"""What a built (meta-device) rank model holds outside its activations: params, grads and optimizer state
as the trainer's optimizer lays them out, the bytes it sends on dp and cp per step, and the shape the phase
model reads (memory/phases.py). memory/rank_plan.py's module doc states each figure."""

from __future__ import annotations

from dataclasses import replace

from megaframe.config.schema import Config
from megaframe.model.attention import Attention
from megaframe.optim.rule_registry import rule_named
from megaframe.optim.sizing import planned_dp_bytes, planned_memory_bytes
from megaframe.parallel.context import cp_bytes_per_layer
from megaframe.parallel.virtual import virtual_mesh
from megaframe.planning.memory.activations import head_activation_bytes
from megaframe.planning.memory.block_memory import on_host as _on_host
from megaframe.planning.memory.phases import RankShape, head_kind


def state_bytes(model, cfg: Config, mesh) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of this rank's model, as the trainer's optimizer lays them
    out on this (virtual) mesh: ZeRO's own buffer code, or one grad and the update rule's state per element.
    (bf16 grad reduction's transient fp32 copy: grads_fp32_bytes.)"""
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.optim.zero:
        # per parameter: a rule may keep other state on hidden matrices than on the rest (Muon)
        rule, dtype = rule_named(cfg.optim.name), cfg.optim.state_dtype
        state = sum(rule.bytes_per_element(dtype, p.placement) * p.numel() for p in params)
        return param_bytes, sum(p.numel() * p.element_size() for p in params), state
    if cfg.optim.zero == 3 and mesh.dp.size == 1:  # build_optimizer: nothing to shard, ZeRO-2's layout
        cfg = replace(cfg, optim=replace(cfg.optim, zero=2))
    mem = planned_memory_bytes(params, cfg.optim, mesh, model)
    return mem.get("mem/params_bytes", param_bytes), mem["mem/grads_bytes"], mem["mem/optim_bytes"]


def optim_bytes_by_dp_rank(model, cfg: Config, tp_rank: int, pp_rank: int, dp: int) -> list[int]:
    """The optimizer state bytes of each dp rank (cp rank 0) of the coordinate `model` was built for."""
    p = cfg.parallel
    at = dict(tp_rank=tp_rank, pp_rank=pp_rank, device="meta", ep=p.ep, etp=p.etp, cp=p.cp)
    at["shard"] = cfg.optim.shard_group_size
    meshes = [virtual_mesh(p.tp, p.pp, dp, dp_rank=r, **at) for r in range(dp)]
    return [state_bytes(model, cfg, mesh)[2] for mesh in meshes]


def grads_fp32_bytes(model, cfg: Config, mesh) -> int:
    """mem/grads_fp32_bytes of this rank: bf16 grad reduction's fp32 copy of the owned grads (0 otherwise)."""
    if cfg.optim.grad_reduce_dtype != "bf16" or not cfg.optim.zero:
        return 0
    if cfg.optim.zero == 3 and mesh.dp.size == 1:  # as state_bytes: ZeRO-2's layout
        cfg = replace(cfg, optim=replace(cfg.optim, zero=2))
    params = [p for p in model.parameters() if p.requires_grad]
    return planned_memory_bytes(params, cfg.optim, mesh, model)["mem/grads_fp32_bytes"]


def dp_comm_bytes(model, cfg: Config, mesh, dp: int) -> int | None:
    """The bytes this rank sends on dp per step under ZeRO; None where the optimizer is not ZeRO."""
    if cfg.optim.zero and not (
        mesh.dp_shard.size == 1 and cfg.train.precision == "fp32"
    ):  # build_optimizer's choice
        m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
        return planned_dp_bytes([p for p in model.parameters() if p.requires_grad], cfg.optim, mesh, m, model)
    return None


def rank_shape(model, cfg: Config, mesh) -> RankShape:
    """What the phase model reads of this rank's (meta) model: its local sizes before ZeRO, the ZeRO-3 units
    its step gathers and reduces, and the largest range its load reads into one destination."""
    from megaframe.optim.buffer import grad_dtype
    from megaframe.optim.param_gather import blocks_of

    ps = list(model.parameters())
    elem = ps[0].element_size()
    blocks = [sum(p.numel() for p in b.parameters()) * elem for b in blocks_of(model)]
    t, o = cfg.train, cfg.optim
    zero = 2 if o.zero == 3 and mesh.dp.size == 1 else o.zero  # build_optimizer: nothing to shard at dp 1
    logits = t.micro_batch_size * cfg.model.seq_length // mesh.cp.size * cfg.model.vocab_size // mesh.tp.size
    out = [p for p in (getattr(model, "final_norm", None), getattr(model, "head", None)) if p is not None]
    out_params = [q for m in out for q in m.parameters()]
    if model.stage.last and cfg.model.tie_embeddings:
        out_params.append(model.embed.weight)
    return RankShape(
        sum(p.numel() for p in ps),
        max(p.numel() for p in ps),
        max(blocks, default=0),
        elem,
        mesh.dp_shard.size if zero else 1,
        mesh.dpcp.size,
        zero,
        logits if model.stage.last else 0,
        sum(blocks),
        grad_elem=grad_dtype(o.grad_reduce_dtype, ps[0].dtype).itemsize,
        out_numel=sum(q.numel() for q in out_params),
        out_acc=not any(q.placement.pp_tied for q in out_params),
        block_param_numel=max((q.numel() for b in blocks_of(model) for q in b.parameters()), default=0),
        head_act=head_activation_bytes(model, t.micro_batch_size) if model.stage.last else 0,
        read_bytes=_read_bytes(model, cfg, mesh, zero, elem),
        gloo=_on_host(cfg),
        head_kind=head_kind(mesh.tp.size, cfg.train.fused_head_loss),
        reshard=cfg.optim.reshard_after_forward,
    )


def _read_bytes(model, cfg: Config, mesh, zero: int, elem: int) -> int:
    """The largest range this rank's resume reads into one destination (memory.phases' load): a whole local
    param (zero 0-2, in its dtype), an fp32 moment (zero=0: whole; ZeRO: its owned segment), and at zero=3
    everything in owned segments (the fp32 master too)."""
    from megaframe.optim.sizing import largest_segment

    ps = [p for p in model.parameters() if p.requires_grad]
    whole = max(p.numel() for p in ps)
    if not zero:
        return 4 * whole
    seg = 4 * largest_segment(ps, replace(cfg.optim, zero=zero), mesh, model)
    return seg if zero == 3 else max(seg, elem * whole)


def cp_bias_bytes(model) -> int:
    """The causal bias [S/cp, S] the layers of a cp rank share under cp_comm=allgather with attention dropout
    (context.cp_causal_bias): built in the first forward and held from then on, once per rank. Without
    dropout the allgather path attends per query chunk and builds no mask (parallel/cp_attention.py)."""
    attn = next((a for b in model.layers.values() for a in b.modules() if isinstance(a, Attention)), None)
    if attn is None or not attn.cp_gathered or not attn.dropout > 0:
        return 0
    p = next(model.parameters())
    return model.cfg.seq_length**2 // attn.cp.size * p.element_size()


def cp_step_bytes(cfg: Config, model, dp: int) -> int:
    """comm_bytes/cp of one step on this rank: every layer it holds, every micro-batch; under document
    masking also the end-of-document flags, one byte a token, all-gathered per micro-batch and chunk."""
    mesh, m, t = model.mesh, cfg.model, cfg.train
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    ring = str(getattr(cfg.parallel.cp_comm, "value", cfg.parallel.cp_comm)) == "ring"
    per = cp_bytes_per_layer(
        m.seq_length,
        mesh.cp.size,
        t.micro_batch_size,
        m.kv_heads // mesh.tp.size,
        m.head_dim,
        next(model.parameters()).element_size(),
        ring,
        t.recompute,
    )
    flags = 0
    if cfg.data.document_mask:
        flags = (
            len(model.stage.chunks) * (mesh.cp.size - 1) * t.micro_batch_size * m.seq_length // mesh.cp.size
        )
    return len(model.layers) * micro * per + micro * flags
