"""`python -m megaframe.data.prepare ARGS` with small units (64 KB), so a small corpus has several per task:
a script, so the tests start it as a fork of the suite's warm interpreter (tests/e2e/warm_start.py)."""

import sys

from megaframe.data import prepare as p

if __name__ == "__main__":
    p.UNIT_BYTES = 64 << 10
    sys.exit(p.main(sys.argv[1:]))
