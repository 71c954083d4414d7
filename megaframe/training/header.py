"""The header a training run prints before its first step (training/startup.py: announce): the layout,
the model, the batch and data, precision and ZeRO, each in the words a Megatron user checks first. `su`
is startup's Setup (model, optimizer, data, evaluator, resume, derived)."""

from __future__ import annotations

from megaframe.config.derived import schedule_kind
from megaframe.config.schema import Config
from megaframe.data.kinds import build_samples, data_kind
from megaframe.parallel.mesh import Mesh
from megaframe.training.metrics import flops_per_token
from megaframe.training.threads import Threads


def data_label(cfg: Config) -> str:
    """What the header calls the data: its kind's label (data/kinds.py)."""
    return data_kind(cfg.data.kind).label(cfg.data)


def describe(cfg: Config, mesh: Mesh, su, total: int, threads: Threads) -> None:
    """Print the derived sizes once, so a user can check the layout before the first step: what a Megatron
    user checks first (precision, pipeline schedule, ZeRO stage, the validation split) included."""
    m, t = cfg.model, cfg.train
    local, share = params_on_rank(su.model, su.optimizer, cfg.optim.zero)
    accum = su.derived.micro_batches
    print(
        f"megaframe | run {cfg.run.dir} | {mesh.describe()} sp={cfg.parallel.sp}{pipeline_label(cfg)} "
        f"{zero_label(cfg, mesh)} | {precision_label(cfg)} | {threads.label}",
        flush=True,
    )
    print(
        f"model {m.name}: {m.num_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads} "
        f"(kv {m.kv_heads}), F={m.ffn_hidden_size}, vocab {m.vocab_size}, {context_label(m, su.resumed.meta)}"
        f"{f', {m.num_experts} experts (top-{m.moe_top_k}, F={m.expert_ffn})' if m.num_experts else ''} | "
        f"params {total / 1e6:.2f}M, {local / 1e6:.2f}M on this rank{share} | "
        f"{flops_per_token(m) / 1e6:.1f} MFLOP/token",
        flush=True,
    )
    samples = "endless" if data_kind(cfg.data.kind).endless else f"{su.data.num_samples}"
    print(
        f"batch {t.global_batch_size} x {m.seq_length} = {su.derived.tokens_per_step} tokens/step, "
        f"micro {t.micro_batch_size}, accumulation {accum} | data {data_label(cfg)}: "
        f"{samples} samples{held_out_label(cfg, su)} | steps {su.resumed.step + 1}..{t.max_steps}",
        flush=True,
    )


def context_label(m, meta: dict | None) -> str:
    """The model's context for the header: seq_length, a change from the resumed checkpoint's (allowed
    for RoPE), and the RoPE scaling an imported model carries (what a continued-pretraining user checks)."""
    saved = ((meta or {}).get("config") or {}).get("model") or {}
    was = saved.get("seq_length")
    seq = f"seq {m.seq_length}"
    if was is not None and int(was) != m.seq_length:
        seq = f"seq_length {was} -> {m.seq_length} (RoPE: allowed at resume)"
    rs = m.rope_scaling
    if m.position_embedding == "rope" and str(rs.rope_type) != "default":
        seq += f", rope {rs.rope_type} x{rs.factor:g}"
    if m.max_position_embeddings and m.max_position_embeddings != m.seq_length:
        seq += f", context {m.max_position_embeddings}"
    return seq


def params_on_rank(model, optimizer, zero: int) -> tuple[int, str]:
    """(parameters this rank holds, a note): under ZeRO-3 its shard of the flat buffers plus any bucket kept
    whole, not the gathered modules' full count (which read as if nothing were sharded)."""
    if zero == 3 and hasattr(optimizer, "resident"):
        shard = sum(buf.state_numel for buf in optimizer.buffers) + sum(
            b.numel for _, b in optimizer.resident
        )
        return shard, " (ZeRO-3 shard)"
    return sum(p.numel() for p in model.parameters()), ""


def precision_label(cfg: Config) -> str:
    p = str(cfg.train.precision)
    if p == "fp32":
        return "precision fp32"
    where = "the blocks and the head" if cfg.train.fp8_head else "the blocks"
    extra = f", float8 {cfg.train.fp8_recipe} GEMMs in {where}" if p == "fp8" else ""
    return f"precision {p} (fp32 master weights{extra})"


def pipeline_label(cfg: Config) -> str:
    """The pipeline schedule (kind and virtual stages); empty without a pipeline, unless the kind is an
    overlapped one (a forward beside a backward: worth seeing at pp = 1 too)."""
    from megaframe.pipeline.schedule import SCHEDULES

    par = cfg.parallel
    kind = schedule_kind(par)
    if par.pp == 1 and not SCHEDULES[kind].overlap:
        return ""
    return f" schedule {kind}{f' vpp={par.vpp}' if par.vpp > 1 else ''}"


def held_out_label(cfg: Config, su) -> str:
    """The validation split's size beside the training samples (data.valid_fraction holds out whole
    documents, so on a small corpus the share can be far above the fraction asked for)."""
    if data_kind(cfg.data.kind).own_valid or cfg.data.valid_fraction <= 0:
        return ""
    m, t = cfg.model, cfg.train
    try:
        held = (
            su.evaluator.data
            if su.evaluator is not None
            else build_samples(cfg.data, m.seq_length, m.vocab_size, t.seed, t.global_batch_size, "valid")
        )
    except (OSError, ValueError, KeyError):  # the header is a courtesy: the evaluator reports a bad split
        return ""
    valid, train = getattr(held, "num_samples", 0), getattr(su.data, "num_samples", 0)
    return f" (+{valid} held out for validation, {100 * valid / max(1, valid + train):.1f}%)" if valid else ""


def precision_warnings(cfg: Config, device: str) -> list[str]:
    """FP8 where it cannot pay: emulated on CPU, and unfused without compile on CUDA (measured at 0.40x
    bf16's speed on an H100 in docs/gpu-first-run.md)."""
    if str(cfg.train.precision) != "fp8":
        return []
    if device == "cpu":
        return [
            "train.precision=fp8 on cpu: float8 is emulated, slower than fp32; it is meant for an "
            "H100-class GPU with train.compile=true"
        ]
    if not cfg.train.compile:
        return [
            "train.precision=fp8 without train.compile=true: the float8 scaling runs unfused, measured "
            "at 0.40x bf16's speed on an H100 (docs/gpu-first-run.md); add train.compile=true"
        ]
    return []


def zero_label(cfg: Config, mesh: Mesh) -> str:
    """The ZeRO stage and what it shards over dp (the params count of a ZeRO-3 run reads as if replicated)."""
    o, dp = cfg.optim, mesh.dp.size
    what = {
        0: "nothing sharded",
        1: "optimizer state sharded",
        2: "optimizer state and grads sharded",
        3: "optimizer state, grads and params sharded",
    }[o.zero]
    over = (
        f"groups of {o.shard_group_size} (HSDP)"
        if o.shard_group_size and o.shard_group_size != dp
        else f"dp={dp}"
    )
    return f"zero={o.zero} ({what}{'' if o.zero == 0 else f' over {over}'})"
