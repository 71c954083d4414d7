"""The printed plan of one layout (`python -m megaframe.plan`): the header, the per-rank table, the
pipeline bubble, each rank's peak per phase with the step's terms, and the fit verdict. The step time, its
band and the reserved line follow from planning.answer."""

from __future__ import annotations

from megaframe.planning.search.report import human


def ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, xs = [], sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def render(plan, cfg) -> str:
    """The printed plan: header, per-rank table, bubble, and the fit verdict."""
    m, lay = cfg.model, plan.layout
    head = (
        f"plan: {m.name} ({m.num_layers} layers, D={m.hidden_size}, seq {m.seq_length}) on "
        f"{plan.world_size} ranks | tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} dp={lay['dp']} "
        f"sp={lay['sp']}{cp_label(lay)}{ep_label(cfg.parallel)} | {lay['precision']}, "
        f"optim.zero={lay['zero']}"
        f"{' shard_group_size=' + str(cfg.optim.shard_group_size) if cfg.optim.shard_group_size else ''}"
        f"{' grad_reduce_dtype=bf16' if lay.get('grad_reduce_dtype') == 'bf16' else ''} | micro-batch "
        f"{lay['micro_batch_size']} x {plan.microbatches} micro-batches per step, schedule {plan.schedule}"
    )
    bubble = (
        [
            f"pipeline bubble: {100 * plan.bubble:.1f}% of the step idle ({plan.schedule}, pp={lay['pp']}, "
            f"vpp={lay['vpp']}, {plan.microbatches} micro-batches)"
        ]
        if lay["pp"] > 1
        else []
    )
    return "\n".join([head, *_table(plan), *bubble, *_phase_lines(plan), *_verdict(plan)])


def _phase_lines(plan) -> list[str]:
    """Each row's peak per phase (planning.memory.phases), the largest named."""
    from megaframe.planning.memory.rank_plan import merged_rows

    lines = ["memory per phase (peak of the rank; a layout fits only if every phase does):"]
    for tps, r in merged_rows(plan):
        if not r.phases:
            continue
        big = max(r.phases, key=r.phases.get)
        cells = " | ".join(f"{k} {human(v)}{' (largest)' if k == big else ''}" for k, v in r.phases.items())
        host = (
            f"; host memory: save +{human(r.host_bytes['save'])}, load +{human(r.host_bytes['load'])}"
            if r.host_bytes
            else ""
        )
        lines.append(f"  pp {r.pp_rank} tp {ranges(tps)}: {cells}{host}")
        # the step's peak by what holds it (planning.memory.phases.step_terms), each term named
        terms = " + ".join(f"{k} {human(v)}" for k, v in r.step_terms.items() if v)
        lines.append(f"    step = {terms}" if terms else "")
    return [x for x in lines if x]


def ep_label(p) -> str:
    """The experts' axes of the header: ep, etp, and dispatch by node where the config sets it."""
    if p.ep * p.etp == 1:
        return ""
    by_node = " by node" if p.ep_dispatch == "node" and p.ep > 1 else ""
    return f" ep={p.ep}{by_node}" + (f" etp={p.etp}" if p.etp > 1 else "")


def cp_label(lay: dict) -> str:
    return f" cp={lay['cp']} ({lay['cp_comm']})" if lay.get("cp", 1) > 1 else ""


def _table(plan) -> list[str]:
    from megaframe.planning.memory.rank_plan import merged_rows

    # "step": the step phase's peak (memory.phases), the one total a rank has; it adds what the state and
    # activations alone miss (the head's logits, gloo's staging copies)
    head = (
        "pp",
        "tp ranks",
        "ranks",
        "params",
        "grads",
        "optim",
        "act/microbatch",
        "in flight",
        "activations",
        "step",
        "dp bytes/step",
        "cp bytes/step",
    )
    rows = [head]
    for tps, r in merged_rows(plan):
        # a long rank list would swamp the table: counted instead
        rows.append(
            (
                str(r.pp_rank),
                ranges(tps),
                ranges(r.ranks) if len(r.ranks) <= 8 else f"{len(r.ranks)} ranks",
                human(r.params_bytes),
                human(r.grads_bytes),
                human(r.optim_bytes),
                " + ".join(human(b) for b in r.chunk_activation_bytes),  # one figure per pipeline chunk
                str(r.peak_inflight),
                human(r.activation_bytes),
                human(r.phases.get("step", r.total_bytes)),
                "-" if r.dp_comm_bytes is None else human(r.dp_comm_bytes),
                human(r.cp_comm_bytes) if r.cp_comm_bytes else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return [
        "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]


def _verdict(plan) -> list[str]:
    from megaframe.planning.memory.rank_plan import merged_rows

    worst = max(plan.ranks, key=lambda r: r.peak_bytes)
    phase = max(worst.phases, key=worst.phases.get) if worst.phases else "step"
    lines = [
        f"largest rank: {worst.ranks[0]} (pp {worst.pp_rank}, tp {worst.tp_rank}) needs "
        f"{human(worst.peak_bytes)} (its {phase})"
    ]
    if plan.device_memory_bytes is None:
        return lines
    cap, mem = human(plan.device_memory_bytes), plan.device_memory_bytes
    # judged with the allocator's headroom over the allocated peaks (Plan.headroom), said when there is one
    said = f" with the allocator's {100 * plan.headroom:.0f} % headroom" if plan.headroom else ""
    over = [r for _, r in merged_rows(plan) if not r.fits]
    for r in over:
        bad = [k for k, v in r.phases.items() if plan.needs(v) > mem] or ["step"]
        lines.append(
            f"DOES NOT FIT: ranks {ranges(r.ranks)} (pp {r.pp_rank}) need {human(plan.needs(r.peak_bytes))}"
            f"{said} > {cap} per device (in {', '.join(bad)})"
        )
    if not over:
        lines.append(
            f"fits: every rank within {cap} per device in every phase{said} "
            f"({human(mem - plan.needs(worst.peak_bytes))} to spare on the largest)"
        )
    return lines
