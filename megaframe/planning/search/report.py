"""What `python -m megaframe.plan ... +search=true` prints (megaframe/plan.py): the ranked layouts of
megaframe.planning.search with their step time, tokens/s, MFU and memory per phase, and how each compares
with the first; and the byte sizes in the units people read.
"""

from __future__ import annotations


def human(n: float) -> str:
    """Bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def search_report(cfg, world, dev, ests, n, dropped, top, cap) -> str:
    from megaframe.planning.search.rank import MODEL_ERROR, ties, why_slower

    m, t = cfg.model, cfg.train
    tokens = t.global_batch_size * m.seq_length
    """The search's ranking as `python -m megaframe.plan ... +search=true` prints it: the model's figures, the
    top layouts with their memory per phase and step-time parts, the ties with #1 and why the rest lose."""
    lines = [
        f"search: {m.name} on {world} x {dev.name} ({human(cap or dev.memory_gb * 2**30)} each) | "
        f"{t.precision}, global batch {t.global_batch_size} x {m.seq_length} = {tokens / 1e6:.2f}M tokens",
        f"model: GEMMs at up to {100 * dev.efficiency:.0f}% "
        f"of {dev.peak(t.precision) / 1e12:.1f} TFLOP/s on a "
        f"size curve, attention at {100 * dev.attn_eff:.0f}%, links at {100 * dev.link_eff:.0f}% of "
        f"{dev.intra_bw / 1e9:.0f} GB/s in a node of {dev.per_node} / {dev.inter_bw / 1e9:.0f} GB/s across; "
        f"bubble from the schedule simulator (sources: megaframe/planning/devices.py)",
        f"{n} valid layouts (ZeRO 0-3, HSDP, grad reduce dtype, micro-batch, recompute), {dropped} dropped "
        f"(a phase over 90% of the memory: start-up, step, save or load), {len(ests)} ranked",
    ]
    if not ests:
        return "\n".join(lines + ["no layout fits: more devices, or a smaller batch / sequence"])
    best = ests[0]
    head = (
        f"{'#':>2}  {'layout':<74} {'step':>9} {'tok/s/dev':>10} {'MFU':>6} {'memory':>10}  "
        f"{'startup/step/save/load (GiB)':<28}  parts (ms)"
    )
    lines.append(head)
    from megaframe.training.metrics import flops_per_token

    for i, e in enumerate(ests[:top], 1):
        tps = tokens / e.step_s / world
        mfu = tps * flops_per_token(m) / dev.peak(t.precision)
        parts = " ".join(f"{k} {v * 1e3:.0f}" for k, v in e.parts.items() if v > 0)
        phases = "/".join(f"{e.phases[k] / 2**30:.1f}" for k in ("startup", "step", "save", "load"))
        lines.append(
            f"{i:>2}  {e.layout.label():<74} {e.step_s:>8.3f}s {tps:>10.0f} {100 * mfu:>5.1f}% "
            f"{human(e.memory_bytes):>10}  {phases:<28}  {parts}"
        )
    k = ties(ests)
    for i, e in enumerate(ests[1:top], 2):
        if i <= k:  # in the tie group: ordered by memory, then simplicity (search.break_ties)
            lines.append(
                f"#{i} ties with #1 ({100 * (e.step_s / best.step_s - 1):+.1f}% time), "
                f"{'+' if e.memory_bytes >= best.memory_bytes else '-'}"
                f"{human(abs(e.memory_bytes - best.memory_bytes))} peak memory"
            )
        else:
            lines.append(f"#{i} loses to #1 by {why_slower(e, best)}")
    if k > 1:
        lines.append(
            f"#1-#{k} ({100 * k / len(ests):.0f}% of the {len(ests)} ranked) are ties: within "
            f"{100 * MODEL_ERROR:.0f}% of the fastest, sqrt(2) x the step-time model's dispersion on "
            "published runs (docs/planning.md#published-runs), so the model cannot order them; ordered "
            "instead by what it knows best: peak memory (whole GiB, the most headroom first), then fewer "
            "parallel axes (fewer collectives); measure the first few (e.g. 20 steps each) before choosing"
        )
    lines.append("run #1 with: " + " ".join(best.layout.overrides()))
    return "\n".join(lines)
