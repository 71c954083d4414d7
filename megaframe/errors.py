"""Bad input ends a command the same way everywhere: one `megaframe: error: <cause>` line on stderr and
exit code 2 (the contract: a bad config, data, checkpoint or tokenizer is named in one line, within
seconds). Entry points catch only the exceptions that mean bad input and `return fail(e)`; anything else
keeps its traceback. A leaf module: the schema and every entry point import it, it imports nothing of
megaframe."""

from __future__ import annotations

import errno
import sys


class ConfigError(ValueError):
    """A bad setting; the message names the field. Entry points turn it into exit code 2."""


class TrainingError(RuntimeError):
    """The run cannot go on and it is not the user's input (that is ConfigError, exit 2): train.py prints
    it on one line and exits 1. Here, not in training/, so checkpoint/ can raise it without importing up."""


def one_line(e: BaseException) -> str:
    """The error and its cause (Hydra puts the reason, e.g. a failed type conversion, in __cause__)."""
    parts = [str(e)] + (
        [str(e.__cause__)] if e.__cause__ is not None and str(e.__cause__) not in str(e) else []
    )
    words = " ".join(" ".join(p.split()) for p in parts)
    words = words.split(" full_key:")[0]  # OmegaConf appends a multi-field context block
    return words or type(e).__name__


# A write the file system refused for want of room or of a writable disk: a full disk, the file-size limit
# (ulimit -f), a quota, a read-only mount. Not bad input (exit 2) and not a bug (a traceback): the tools say
# it in one line and exit 1, like a checkpoint save that could not be committed.
WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)


def write_refused(e: BaseException) -> bool:
    """Whether `e` is such a refused write: an OSError with one of WRITE_ERRNOS, or safetensors' own
    SafetensorError (not an OSError), which carries the errno only in its text, `(os error 28)`."""
    if isinstance(e, OSError):
        return e.errno in WRITE_ERRNOS
    return type(e).__name__ == "SafetensorError" and any(f"(os error {n})" in str(e) for n in WRITE_ERRNOS)


def fail(msg: object, code: int = 2, prefix: str = "") -> int:
    """Print `megaframe: error: <msg>` (whitespace folded to one line) on stderr; returns `code`, the
    exit status of the entry point's main() (`return fail(e)`): 2 for bad input, 1 for a failed run."""
    text = " ".join(str(msg).split())
    print(f"{prefix}megaframe: error: {text}", file=sys.stderr, flush=True)
    _tell_torchrun(f"megaframe: error: {text}")
    return code


def _tell_torchrun(line: str) -> None:
    """Under torchrun, the line goes into the worker's error file too: torchrun's failure summary, the ~35
    lines that follow it, then ends with it (`traceback : megaframe: error: ...`) instead of a link."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:  # the summary is a convenience: the line is on stderr already
        pass
