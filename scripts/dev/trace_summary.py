"""Summarise the traces train.profile_steps wrote: per rank, the named ranges found and, per kind of
range (forward, backward, backward_input, backward_weight, each collective kind per axis, the optimizer
step), how many and their total time in one step.

    python scripts/dev/trace_summary.py RUN_DIR/profile [--step N]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megaframe.plot_views import read_trace, step_ranges, trace_files  # noqa: E402


def kind_key(name: str) -> str:
    """forward / backward / ... or comm.<op>[<axis>] (bytes and shapes dropped)."""
    head = name.split(" ")[0]
    return re.sub(r"^(comm\.p2p).*", r"\1", head)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("where", help="a trace or the profile/ folder")
    ap.add_argument("--step", type=int)
    args = ap.parse_args(argv)
    for rank, path in sorted(trace_files(args.where).items()):
        ranges = step_ranges(read_trace(path), args.step)
        count, total = defaultdict(int), defaultdict(float)
        for _, name, _, dur in ranges:
            count[kind_key(name)] += 1
            total[kind_key(name)] += dur
        print(f"rank {rank}: {len(ranges)} named ranges in the step ({path.name})")
        for k in sorted(total, key=lambda k: -total[k]):
            print(f"  {k:<34}{count[k]:>5} x  {1e3 * total[k]:>9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
