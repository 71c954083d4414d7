"""Draw pipeline schedules as timeline PNGs: ranks x time, F / B / W per chunk, bubble visible.

    python scripts/plot_schedule.py pp=4 vpp=2 microbatches=8 [kind=interleaved] [out=schedule.png]
    python scripts/plot_schedule.py pp=4 microbatches=8 kind=1f1b,zb_h1,zbv costs=1:1:1
                                    out=docs/zero_bubble.png

The picture comes from the same data the trainer executes (megaframe.pipeline.schedule) run through
the process-free simulator. Without `costs` one time unit is one chunk's F or B (zero-bubble kinds: B and
W one unit each); `costs=F:B:W` gives a whole stage's times (a chunk takes 1/vpp; kinds that do not split
the backward run B + W as one B), so several kinds compare at equal work. Several kinds (comma-separated)
are drawn one above the other; each prints its `bubble=` (idle / makespan) and `idle=` (idle time) line.
A kind that fixes vpp (1f1b, zb_h1: 1; zbv: 2) uses it unless vpp= is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megaframe.pipeline.schedule import B, F, W, admitted_vpps, check_args, resolve_kind, splits_backward  # noqa: E402
from megaframe.pipeline.simulate import Costs, bubble_formula, simulate  # noqa: E402

COLOURS = {F: ["#4C78A8", "#9ECAE9"], B: ["#F58518", "#FFBF79"], W: ["#54A24B", "#88D27A"]}


def parse(argv: list[str]) -> dict:
    args = {"pp": "4", "vpp": None, "microbatches": "8", "kind": "auto", "out": "schedule.png", "costs": None}
    for a in argv:
        key, _, value = a.partition("=")
        if key not in args:
            _bad(f"unknown argument {key!r} (got {a!r}); expected {', '.join(args)}")
        args[key] = value
    return args


def _bad(msg: str) -> None:
    print(f"plot_schedule: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _costs(text: str | None) -> Costs | None:
    if text is None:
        return None
    try:
        f, b, w = (float(x) for x in text.split(":"))
    except ValueError:
        _bad(f"costs={text!r} must be F:B:W, three numbers (e.g. 1:1:1)")
    if min(f, b, w) < 0 or f <= 0:
        _bad(f"costs={text!r}: F must be > 0 and B, W >= 0")
    return Costs(f, b, w)


def _draw(ax, kind: str, pp: int, vpp: int, m: int, costs: Costs | None):
    res = simulate(kind, pp, vpp, m, costs=costs)
    scale = 1.0 / vpp if costs is not None else 1.0
    split = splits_backward(kind)
    for r, events in enumerate(res.timeline):
        for t, a in events:
            unit = costs or (Costs(1, 1, 1) if split else Costs(1, 1, 0))
            width = unit.of(a.kind, split) * scale
            ax.barh(r, width, left=t, color=COLOURS[a.kind][a.chunk % 2], edgecolor="white", linewidth=0.6)
            if width >= 0.4:
                ax.text(
                    t + width / 2, r, str(a.microbatch), ha="center", va="center", fontsize=6, color="black"
                )
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, res.makespan)
    ax.set_title(
        f"{kind}: pp={pp} vpp={vpp} m={m} | idle time {res.idle:g}, idle/makespan {res.bubble:.3f}",
        fontsize=9,
    )
    return res


def plot(kinds: list[str], pp: int, vpps: list[int], m: int, out: str, costs: Costs | None = None) -> list:
    fig, axes = plt.subplots(len(kinds), 1, squeeze=False, figsize=(11, (0.5 * pp + 1.0) * len(kinds) + 0.8))
    results = [_draw(ax, k, pp, v, m, costs) for ax, k, v in zip(axes[:, 0], kinds, vpps)]
    span = max(r.makespan for r in results)
    for ax in axes[:, 0]:
        ax.set_xlim(0, span)  # one time axis: the kinds compare by length
    unit = "one chunk's F or B" if costs is None else f"F:B:W = {costs.f:g}:{costs.b:g}:{costs.w:g} per stage"
    axes[-1, 0].set_xlabel(f"time ({unit})")
    legend = [Patch(color=colour, label=label) for label, colour in legend_entries(results)]
    axes[-1, 0].legend(
        handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(legend), fontsize=8
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return results


def legend_entries(results: list) -> list[tuple[str, str]]:
    """(label, colour) of each action kind and chunk colour the drawn schedules use, in F, B, W order:
    an interleaved schedule draws no W, so its legend names none (it listed every kind for every chunk)."""
    used: dict[tuple, list[int]] = {}
    for chunk, kind in sorted({(a.chunk, a.kind) for res in results for ev in res.timeline for _, a in ev}):
        used.setdefault((kind, chunk % 2), []).append(chunk)
    return [
        (f"{k} chunk {','.join(map(str, used[(k, c)]))}", COLOURS[k][c])
        for k in (F, B, W)
        for c in (0, 1)
        if (k, c) in used
    ]


def _default_vpp(name: str, pp: int, m: int) -> int:
    """The one vpp a kind's chunk rule admits (1f1b, zb_h1: 1; zbv: 2), else 2 (auto: interleaved)."""
    admitted = admitted_vpps(name, pp, m)
    return admitted[0] if len(admitted) == 1 else 2


def main(argv: list[str]) -> None:
    a = parse(argv)
    try:
        pp, m = int(a["pp"]), int(a["microbatches"])
        given = None if a["vpp"] is None else int(a["vpp"])
    except ValueError:
        _bad(
            f"pp, vpp and microbatches must be integers (got pp={a['pp']} vpp={a['vpp']} "
            f"microbatches={a['microbatches']})"
        )
    kinds, vpps = [], []
    for name in a["kind"].split(","):
        vpp = given if given is not None else _default_vpp(name, pp, m)
        kind = resolve_kind(name, vpp)
        try:
            check_args(kind, pp, vpp, m)
        except ValueError as e:
            _bad(f"{e} (got kind={name} pp={pp} vpp={vpp} microbatches={m})")
        kinds.append(kind)
        vpps.append(vpp)
    costs = _costs(a["costs"])
    results = plot(kinds, pp, vpps, m, a["out"], costs)
    # what was written and its figure: a silent command left the user looking for the file
    print(f"plot_schedule: wrote {Path(a['out']).resolve()} (bubble = idle / makespan)")
    for kind, vpp, res in zip(kinds, vpps, results):
        print(
            f"  {kind} pp={pp} vpp={vpp} m={m} bubble={res.bubble:.4f} idle={res.idle:g} "
            f"formula={bubble_formula(pp, vpp, m):.4f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
