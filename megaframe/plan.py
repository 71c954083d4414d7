"""Dry-run planner: per-rank memory and the pipeline bubble of a layout, without any process group.

    python -m megaframe.plan [hydra overrides] +world_size=N [+device_memory_gb=X] [+plan_json=PATH]

The config is composed and validated as train.py does (megaframe.config.load_config; prepared data
is not read, since planning happens before it exists), so a layout train.py would refuse exits 2 with
the same one-line message. `+world_size` (required unless $WORLD_SIZE is set), `+device_memory_gb`
(GiB per device) and `+plan_json` are the planner's own and are removed before composing. Every
rank's model is then built on the meta device with a virtual mesh (megaframe.planning.estimate).
A rank over the device memory prints a `DOES NOT FIT` line (exit code 0: the plan itself worked).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OWN_KEYS = ("world_size", "device_memory_gb", "plan_json")


def split_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Hydra overrides and the planner's own `+key=value` settings (also accepted without the +)."""
    overrides, own = [], {}
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if key in OWN_KEYS and value:
            own[key] = value
        else:
            overrides.append(a)
    return overrides, own


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


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
    head = (f"plan: {m.name} ({m.num_layers} layers, D={m.hidden_size}, seq {m.seq_length}) on "
            f"{plan.world_size} ranks | tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} dp={lay['dp']} "
            f"sp={lay['sp']} | {lay['precision']}, optim.zero={lay['zero']}"
            f"{' shard_group_size=' + str(cfg.optim.shard_group_size) if cfg.optim.shard_group_size else ''} | micro-batch "
            f"{lay['micro_batch_size']} x {plan.microbatches} micro-batches per step, schedule {plan.schedule}")
    bubble = (f"pipeline bubble: {100 * plan.bubble:.1f}% of the step idle ({plan.schedule}, pp={lay['pp']}, "
              f"vpp={lay['vpp']}, {plan.microbatches} micro-batches)")
    return "\n".join([head, *_table(plan), bubble, *_verdict(plan)])


def _table(plan) -> list[str]:
    from megaframe.planning.estimate import merged_rows

    head = ("pp", "tp ranks", "ranks", "params", "grads", "optim", "act/microbatch", "in flight", "activations",
            "total", "dp bytes/step")
    rows = [head]
    for tps, r in merged_rows(plan):
        rows.append((str(r.pp_rank), ranges(tps), ranges(r.ranks) if len(r.ranks) <= 8 else f"{len(r.ranks)} ranks",
                     human(r.params_bytes), human(r.grads_bytes), human(r.optim_bytes),
                     " + ".join(human(b) for b in r.chunk_activation_bytes),  # one figure per pipeline chunk
                     str(r.peak_inflight), human(r.activation_bytes), human(r.total_bytes),
                     "-" if r.dp_comm_bytes is None else human(r.dp_comm_bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


def _verdict(plan) -> list[str]:
    from megaframe.planning.estimate import merged_rows

    worst = max(plan.ranks, key=lambda r: r.total_bytes)
    lines = [f"largest rank: {worst.ranks[0]} (pp {worst.pp_rank}, tp {worst.tp_rank}) needs "
             f"{human(worst.total_bytes)}"]
    if plan.device_memory_bytes is None:
        return lines
    cap = human(plan.device_memory_bytes)
    over = [r for _, r in merged_rows(plan) if not r.fits]
    for r in over:
        lines.append(f"DOES NOT FIT: ranks {ranges(r.ranks)} (pp {r.pp_rank}) need {human(r.total_bytes)} "
                     f"> {cap} per device")
    if not over:
        lines.append(f"fits: every rank within {cap} per device "
                     f"({human(plan.device_memory_bytes - worst.total_bytes)} to spare on the largest)")
    return lines


def main(argv: list[str]) -> int:
    from megaframe.config import ConfigError, load_config

    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    overrides, own = split_args(argv)
    try:
        world = int(own["world_size"]) if "world_size" in own else None
        memory = float(own["device_memory_gb"]) if "device_memory_gb" in own else None
        world = world or int(os.environ.get("WORLD_SIZE", "0"))
        if world < 1:
            raise ValueError("+world_size=N (the number of ranks to plan for) is required")
        cfg = load_config(overrides, world_size=world, check_data=False)
    except ValueError as e:  # ConfigError is a ValueError; so is a bad +world_size
        print(f"megaframe: error: {e if isinstance(e, ConfigError) else 'plan settings: ' + str(e)}",
              file=sys.stderr, flush=True)
        return 2
    from megaframe.planning.estimate import plan_layout

    plan = plan_layout(cfg, world, memory)
    print(render(plan, cfg), flush=True)
    if "plan_json" in own:
        Path(own["plan_json"]).write_text(json.dumps(plan.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
