"""The other pictures `python -m megaframe.plot` draws: one profiled step per rank (--trace) and a run's
goodput (--goodput).

--trace reads the Chrome traces train.profile_steps wrote (a trace file, or the profile/ folder: every
rank's trace of the same steps) and draws one step as a timeline, one row per rank: its pipeline actions
(forward, backward or backward_input, backward_weight; labelled micro-batch.chunk) like the schedule
pictures of docs/pipeline.md, its collectives below them and the optimizer step. Each rank's row starts at
its own `step N` range: ranks on different hosts have different clocks.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "backward_input": "#DD8452",
    "backward_weight": "#55A868",
    "optimizer_step": "#8172B3",
    "comm": "#937860",
}
TRACE_NAME = re.compile(r"rank(\d+)_steps(\d+)-(\d+)\.json(\.gz)?$")


def read_trace(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace, .json or .json.gz; ValueError naming the file."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        events = json.loads(text)["traceEvents"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Chrome trace ({type(e).__name__}: {e})") from None
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def trace_files(where: str) -> dict[int, Path]:
    """{rank: trace} of a trace file or a profile folder (the first steps range found in it)."""
    p = Path(where)
    if p.is_file():
        m = TRACE_NAME.search(p.name)
        return {int(m.group(1)) if m else 0: p}
    if not p.is_dir():
        raise ValueError(f"--trace {where}: no such file or folder")
    try:
        names = list(p.iterdir())
    except OSError as e:  # a folder we may not read
        raise ValueError(f"--trace {where}: cannot list it ({e.strerror})") from None
    found = sorted(((TRACE_NAME.search(f.name), f) for f in names if TRACE_NAME.search(f.name)),
                   key=lambda mf: (mf[0].group(2, 3), int(mf[0].group(1))))  # fmt: skip
    if not found:
        raise ValueError(f"--trace {where}: no rank<R>_steps<A>-<B>.json(.gz) trace in it")
    steps = found[0][0].group(2, 3)
    return {int(m.group(1)): f for m, f in found if m.group(2, 3) == steps}


def kind_of(name: str) -> str | None:
    """The range kind of an event name megaframe gave (None: torch's own events)."""
    head = name.split(" ")[0]
    if head in ("forward", "backward", "backward_input", "backward_weight", "optimizer_step"):
        return head
    return "comm" if head.startswith("comm.") else None


def step_ranges(events: list[dict], step: int | None) -> list[tuple[str, str, float, float]]:
    """(kind, name, start s, duration s) of the named ranges inside step `step` (None: the first
    profiled), times from that step's start."""
    every = sorted((e for e in events if re.fullmatch(r"step \d+", e["name"])), key=lambda e: e["ts"])
    steps = [e for e in every if step is None or e["name"] == f"step {step}"]
    if not steps:
        held = ", ".join(e["name"] for e in every) or "none"
        raise ValueError(
            f"no 'step {step if step is not None else 'N'}' range in the trace (it holds: {held})"
        )
    t0, t1 = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
    out = []
    for e in events:
        kind = kind_of(e["name"])
        if kind and t0 <= e["ts"] <= t1:
            out.append((kind, e["name"], (e["ts"] - t0) / 1e6, e["dur"] / 1e6))
    return sorted(out, key=lambda r: r[2])


def draw_trace(where: str, out: str, step: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = trace_files(where)
    rows = {}
    for r, f in sorted(files.items()):
        try:
            rows[r] = step_ranges(read_trace(f), step)
        except ValueError as e:
            raise ValueError(f"{f}: {e}" if str(f) not in str(e) else str(e)) from None
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.9 * len(rows)))
    for y, ranges in enumerate(rows.values()):
        for kind, name, t, d in ranges:
            comm = kind == "comm"
            ax.broken_barh([(t, d)], (y + (0.05 if comm else 0.35), 0.25 if comm else 0.55),
                           color=COLORS[kind], alpha=0.6 if comm else 0.9)  # fmt: skip
            label = re.search(r"mb(\d+) chunk(\d+)", name)
            if label and d > 0:
                ax.text(t + d / 2, y + 0.62, f"{label.group(1)}.{label.group(2)}", ha="center",
                        va="center", fontsize=6, color="white")  # fmt: skip
    ax.set_yticks([y + 0.5 for y in range(len(rows))], [f"rank {r}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the step's start (each rank's own clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), fontsize=7, ncol=len(COLORS), loc="upper right")
    ax.set_title("one profiled step per rank: pipeline actions (mb.chunk), collectives below")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return Path(out)


def draw_goodput(run_dir: str, out: str) -> Path:
    """One stacked bar of the run's wall time by goodput bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megaframe.runops import goodput_account as goodput

    fig_data = goodput.of_folder(run_dir)
    fig, ax = plt.subplots(figsize=(11, 2.2))
    left = 0.0
    for i, k in enumerate((*goodput.BUCKETS, "other")):
        v = fig_data[f"goodput/{k}_s"]
        ax.barh([0], [v], left=left, color=f"C{i}", label=f"{k} {v:.1f}s")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds of wall time, every incarnation")
    ax.set_title(f"{Path(run_dir).name}: goodput {100 * fig_data['goodput/fraction']:.1f}%")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return Path(out)
