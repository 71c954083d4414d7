"""Draw a pipeline schedule as a timeline PNG: ranks x time, forward/backward per chunk, bubble visible.

    python scripts/plot_schedule.py pp=4 vpp=2 microbatches=8 [kind=interleaved] [out=schedule.png]

The picture comes from the same data the trainer executes (megaframe.pipeline.schedule) run through
the process-free simulator (one time unit per chunk forward or backward).
"""
from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megaframe.pipeline.schedule import F, resolve_kind  # noqa: E402
from megaframe.pipeline.simulate import bubble_formula, simulate  # noqa: E402

FWD = ["#4C78A8", "#72B7B2", "#54A24B", "#B279A2"]
BWD = ["#F58518", "#E45756", "#EECA3B", "#9D755D"]


def parse(argv: list[str]) -> dict:
    args = {"pp": "4", "vpp": "2", "microbatches": "8", "kind": "auto", "out": "schedule.png"}
    for a in argv:
        key, _, value = a.partition("=")
        if key not in args:
            raise SystemExit(f"unknown argument {key!r}; expected {', '.join(args)}")
        args[key] = value
    return args


def plot(kind: str, pp: int, vpp: int, m: int, out: str) -> float:
    res = simulate(kind, pp, vpp, m)
    fig, ax = plt.subplots(figsize=(max(8, res.makespan * 0.22), 0.6 * pp + 1.6))
    for r, events in enumerate(res.timeline):
        for t, a in events:
            color = (FWD if a.kind == F else BWD)[a.chunk % 4]
            ax.barh(r, 1, left=t, color=color, edgecolor="white", linewidth=0.6)
            ax.text(t + 0.5, r, str(a.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, res.makespan)
    ax.set_xlabel("time (one unit = one chunk's forward or backward)")
    ax.set_title(f"{kind}: pp={pp} vpp={vpp} microbatches={m} | bubble {res.bubble:.3f} "
                 f"(formula (pp-1)/(vpp*m+pp-1) = {bubble_formula(pp, vpp, m):.3f})", fontsize=10)
    legend = [Patch(color=FWD[c % 4], label=f"F chunk {c}") for c in range(vpp)]
    legend += [Patch(color=BWD[c % 4], label=f"B chunk {c}") for c in range(vpp)]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2 * vpp, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    return res.bubble


def main(argv: list[str]) -> None:
    a = parse(argv)
    pp, vpp, m = int(a["pp"]), int(a["vpp"]), int(a["microbatches"])
    kind = resolve_kind(a["kind"], vpp)
    bubble = plot(kind, pp, vpp, m, a["out"])
    print(f"{a['out']}: {kind} pp={pp} vpp={vpp} m={m} bubble={bubble:.4f} formula={bubble_formula(pp, vpp, m):.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
