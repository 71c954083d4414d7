"""`python -m megaframe.data.prepare ARGS` with many small shards in one unit, each taking 0.25 s (a slow
tokenizer, a large corpus): a second process started once the first shard exists finds the first mid-unit.
$START_AFTER delays main() until that file exists, so both have imported everything by then. A script, so
the tests start it as a fork of the suite's warm interpreter (tests/e2e/warm_start.py)."""

import os
import sys
import time

from megaframe.data import prepare as p
from megaframe.data.prepare import unit_encoding as u


def slow(task, real=u.encode_chunk):
    time.sleep(0.25)
    return real(task)


if __name__ == "__main__":
    u.MAX_CHUNK_CHARS = u.MIN_CHUNK_CHARS = 8 << 10
    u.encode_chunk = slow
    wait = os.environ.get("START_AFTER")
    while wait and not os.path.exists(wait):
        time.sleep(0.02)
    sys.exit(p.main(sys.argv[1:]))
