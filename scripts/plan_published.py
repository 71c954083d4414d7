"""The planner against published training runs, every figure from the command line a user types: for each
row of megaframe/planning/published_runs.json, `python -m megaframe.plan <its overrides> +world_size=N
+device=NAME +plan_json=...` (run in this process, megaframe.plan.main), and the table of planned over
published step time by kind of layout (dense / moe / cp / small at large dp), with the error per kind.

    python scripts/plan_published.py             # prints the table
    python scripts/plan_published.py --write     # and into docs/planning.md between its markers (the
                                                 # rows' figures: planning/published_planned.json)
    python scripts/plan_published.py --only MPT  # the rows whose name contains MPT (no --write)

Nothing here feeds the model: the rows carry only what the user would type and the published figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "planning.md"
PLANNED = ROOT / "megaframe" / "planning" / "published_planned.json"
BEGIN, END = "<!-- published-runs: begin -->", "<!-- published-runs: end -->"


def plan_row(row: dict) -> dict:
    """The row planned as the command line plans it: its +plan_json figures."""
    from megaframe.plan import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        args = [*row["overrides"], f"+world_size={row['world_size']}", f"+device={row['device']}"]
        with contextlib.redirect_stdout(io.StringIO()):
            code = main([*args, f"+plan_json={out}"])
        if code:
            return {"error": f"exit {code}"}
        return json.loads(out.read_text())


def table(rows: list[dict], planned: list[dict]) -> str:
    from megaframe.planning.error_bands import KINDS, spread, summary

    lines = []
    for kind in KINDS:
        mine = [(r, p) for r, p in zip(rows, planned) if p["layout_kind"] == kind]
        if not mine:
            continue
        ratios = [p["step_time_s"] / r["published_step_s"] for r, p in mine]
        s = summary(ratios)
        lo, hi = spread(ratios, [p["step_time_s"] / r["published_step_s"] for r, p in zip(rows, planned)])
        lines += [
            f"**{kind}** ({len(mine)} runs): ratio median {s['median']:.2f}, median absolute error "
            f"{100 * s['mae']:.0f} %, range {s['lo']:.2f}-{s['hi']:.2f}; `plan`'s band for a {kind} layout: "
            f"its step time / {hi:.2f} to / {lo:.2f}",
            "",
            "| run | set | device x N | published s | planned s (band) | ratio | fits | memory GiB "
            "published / planned reserved |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r, p in mine:
            mem = "-"
            if r.get("published_memory_gib"):
                mem = f"{r['published_memory_gib']:.1f} / {p['reserved_bytes'] / 2**30:.1f}"
            lo, hi = p["step_time_band_s"]
            lines.append(
                f"| {r['name']} ({r['source']}) | {r['set']} | {r['device']} x {r['world_size']} | "
                f"{r['published_step_s']:.2f} | {p['step_time_s']:.2f} ({lo:.2f}-{hi:.2f}) | "
                f"{p['step_time_s'] / r['published_step_s']:.2f} | {p['fits']} | {mem} |"
            )
        lines.append("")
    every = summary([p["step_time_s"] / r["published_step_s"] for r, p in zip(rows, planned)])
    lines.append(
        f"All {len(rows)} runs: ratio median {every['median']:.2f}, median absolute error "
        f"{100 * every['mae']:.0f} %, range {every['lo']:.2f}-{every['hi']:.2f}, dispersion "
        f"{100 * every['dispersion']:.1f} % (the search's tie band: sqrt(2) x it, "
        f"{100 * 2**0.5 * every['dispersion']:.1f} %); "
        f"{sum(1 for p in planned if p['fits'])} of {len(rows)} planned to fit (each trained on its device)."
    )
    return "\n".join(lines)


def main() -> int:
    from megaframe.planning.error_bands import load_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="put the table in docs/planning.md")
    ap.add_argument("--only", default="", help="only the rows whose name contains this")
    args = ap.parse_args()
    rows = [r for r in load_rows() if args.only in r["name"]]
    planned = []
    for r in rows:
        t0 = time.monotonic()
        planned.append(plan_row(r))
        p = planned[-1]
        print(
            f"{r['name']}: {p.get('step_time_s', 0):.3f} s / {r['published_step_s']:.3f} published, fits "
            f"{p.get('fits')} {p.get('error', '')} ({time.monotonic() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    if any("error" in p for p in planned):
        return 1
    new = table(rows, planned)
    print(new)
    if args.write and not args.only:
        text = PAGE.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        PAGE.write_text(text[:start] + "\n" + new + "\n" + text[end:])
        # what the test holds the summary and a row of each kind to (re-planning all 52 takes minutes)
        figures = [
            {
                "name": r["name"],
                "kind": p["layout_kind"],
                "published_step_s": r["published_step_s"],
                "step_time_s": p["step_time_s"],
                "fits": p["fits"],
                "reserved_gib": p["reserved_bytes"] / 2**30,
                "step_parts_s": p["step_parts_s"],
            }
            for r, p in zip(rows, planned)
        ]
        PLANNED.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
