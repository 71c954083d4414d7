"""The plan's answer for the layout as given: its step time with the error band of its kind of layout
(planning.error_bands), tokens/s, MFU, peak memory and whether it fits."""

from __future__ import annotations

from megaframe.planning.error_bands import RATIO_SPREAD, band, layout_kind, param_count
from megaframe.planning.steptime.moe import spans_nodes


def layout_timing(cfg, world: int, dev, plan) -> dict:
    """The step-time model (steptime.timing) of the layout as given: step_time_s, tokens_per_s_per_device,
    mfu (model FLOPs, training.metrics, over the device's peak at train.precision), the largest phase
    peak (peak_bytes) and fits, with the step's parts."""
    from megaframe.planning.steptime.timing import step_time
    from megaframe.training.metrics import flops_per_token

    p, t = cfg.parallel, cfg.train
    lay = cli_layout(cfg, plan.layout["dp"])
    parts = step_time(cfg, lay, dev, world)
    step = sum(parts.values())
    tps = t.global_batch_size * cfg.model.seq_length / step / world
    prec = str(getattr(t.precision, "value", t.precision))
    across = spans_nodes(lay, p.etp, dev)
    kind = layout_kind(
        cfg.model.num_experts, p.cp, p.tp, p.pp, plan.layout["dp"], param_count(cfg.model), across
    )
    return {
        "device": dev.name,
        "step_time_s": step,
        "layout_kind": kind,
        "step_time_band_s": list(band(step, kind)),
        "tokens_per_s_per_device": tps,
        "mfu": tps * flops_per_token(cfg.model) / dev.peak(prec),
        "step_parts_s": parts,
        "peak_bytes": max(r.peak_bytes for r in plan.ranks),
        "fits": plan.fits,
        "reserved_bytes": int(max(r.peak_bytes for r in plan.ranks) * (1 + dev.alloc_headroom)),
    }


def timing_line(tm: dict) -> str:
    parts = " ".join(f"{k} {v * 1e3:.0f}" for k, v in tm["step_parts_s"].items() if v > 0)
    lo, hi = tm["step_time_band_s"]
    kind = tm["layout_kind"]
    r_lo, r_hi = RATIO_SPREAD[kind]
    return (
        f"step time on {tm['device']}: {tm['step_time_s']:.3f} s, {tm['tokens_per_s_per_device']:.0f} "
        f"tokens/s per device, MFU {100 * tm['mfu']:.1f}% (parts, ms: {parts})\n"
        f"  band {lo:.3f}-{hi:.3f} s: a {kind} layout; on published {kind} runs this model's step time was "
        f"{r_lo:.2f}-{r_hi:.2f} x the published one (10th-90th percentile, docs/planning.md#published-runs)"
    )


def cli_layout(cfg, dp: int):
    """The planning.candidate.Layout of the config as given (its parallel, optim and train keys)."""
    from megaframe.planning.candidate import Layout

    p, t, o = cfg.parallel, cfg.train, cfg.optim
    return Layout(
        p.tp,
        p.pp,
        p.vpp,
        dp,
        p.ep,
        o.zero,
        t.micro_batch_size,
        str(getattr(t.recompute, "value", t.recompute)),
        p.cp,
        o.shard_group_size,
        str(getattr(o.grad_reduce_dtype, "value", o.grad_reduce_dtype)),
        "",
        tuple(p.pp_layout or ()),
        sp=p.sp,
    )


def cli_step_seconds(cfg, world: int, dev) -> dict[str, float]:
    """The step's parts as `plan` times the config on `world` ranks (dp from the config's derivation)."""
    from megaframe.config.derived import derive
    from megaframe.planning.steptime.timing import step_time

    return step_time(cfg, cli_layout(cfg, derive(cfg, world).dp), dev, world)
