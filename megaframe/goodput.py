"""Where a run's wall time went, over every start of its folder (runops/goodput_account.py: the buckets):

    python -m megaframe.goodput RUN_DIR [--json]

Reads ${RUN_DIR}/metrics.jsonl (finished or still running) and prints the table: productive steps,
start-up per phase, data waits, checkpoint blocking, evaluation, lost progress, restart and queue gaps,
the rest, and the fraction of the wall that trained the model. A folder without clocked metrics exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from megaframe.errors import fail
from megaframe.runops import goodput_account as goodput


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaframe.goodput", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run folder (run.dir) holding metrics.jsonl")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = ap.parse_args(argv)
    try:
        figures = goodput.of_folder(args.run_dir)
    except ValueError as e:
        return fail(e)
    except OSError as e:  # a folder we may not read
        return fail(f"{args.run_dir}: cannot read metrics.jsonl ({e})")
    print(json.dumps(figures) if args.json else goodput.table(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
