"""The planner against published training runs: regenerates docs/planning.md's table (between the
`published-runs` markers) from megaframe.planning.published.

    python benchmarks/validate_published.py [--check]

--check: exit 1 when the page's table differs from what the planner computes now (the test runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "planning.md"
BEGIN, END = "<!-- published-runs: begin -->", "<!-- published-runs: end -->"


def table() -> str:
    from megaframe.planning.published import RUNS, evaluate, search_gap

    rows = [evaluate(r) for r in RUNS]
    lines = [
        "| run (source) | layout | published s | planned s | ratio | memory GiB published / planned "
        "| search: place, vs fastest |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, e in zip(RUNS, rows):
        mem = (
            f"{e['published_gib']:.1f} / {e['planned_gib']:.1f} ({e['memory_ratio']:.2f})"
            if "published_gib" in e
            else "-"
        )
        gap = "-"
        if r.table1:
            g = search_gap(r)
            gap = f"#{g['place']} of {g['ranked']}, +{100 * g['gap']:.1f} % (#1 {g['first']})"
        lines.append(
            f"| {e['name']}{' (held out)' if e['held_out'] else ''} ({e['source']}) | {e['layout']} | "
            f"{e['published_s']:.2f} | {e['planned_s']:.2f} | {e['ratio']:.2f} | {mem} | {gap} |"
        )
    given = [e["ratio"] for e in rows if not e["held_out"]]
    held = [e["ratio"] for e in rows if e["held_out"]]
    errors = [abs(e["ratio"] - 1) for e in rows]
    lines.append("")
    lines.append(
        f"Step-time ratio (planned / published): median {statistics.median(given):.2f} over the first "
        f"{len(given)} runs (range {min(given):.2f}-{max(given):.2f}), median {statistics.median(held):.2f} "
        f"over the {len(held)} held-out ones (range {min(held):.2f}-{max(held):.2f}); median error "
        f"{100 * statistics.median(errors):.1f} % over all. Two layouts' estimates each off by that much "
        f"differ by about sqrt(2) times it: {100 * 2**0.5 * statistics.median(errors):.1f} %, the search's "
        f"tie band (search.MODEL_ERROR)."
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = PAGE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = table()
    if args.check:
        same = text[start:end].strip() == new.strip()
        print("docs/planning.md's published-run table is current" if same else "the table differs:\n" + new)
        return 0 if same else 1
    PAGE.write_text(text[:start] + "\n" + new + "\n" + text[end:])
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
