"""Bad input ends a command the same way everywhere: one `megaframe: error: <cause>` line on stderr and
exit code 2 (the contract: a bad config, data, checkpoint or tokenizer is named in one line, within
seconds). A leaf module: the schema and every entry point import it, it imports nothing of megaframe."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, NoReturn


class ConfigError(ValueError):
    """A bad setting; the message names the field. Entry points turn it into exit code 2."""


def one_line(e: BaseException) -> str:
    """The error and its cause (Hydra puts the reason, e.g. a failed type conversion, in __cause__)."""
    parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ is not None and str(e.__cause__) not in str(e) else [])
    words = " ".join(" ".join(p.split()) for p in parts)
    words = words.split(" full_key:")[0]  # OmegaConf appends a multi-field context block
    return words or type(e).__name__


def fail(msg: object, code: int = 2, prefix: str = "") -> NoReturn:
    """Print `megaframe: error: <msg>` (whitespace folded to one line) and exit with `code`."""
    text = " ".join(str(msg).split())
    print(f"{prefix}megaframe: error: {text}", file=sys.stderr, flush=True)
    raise SystemExit(code)


@contextmanager
def exit_on(*kinds: type[BaseException], code: int = 2) -> Iterator[None]:
    """Turn the listed exceptions (default: ConfigError) raised inside the block into `fail`'s one line;
    anything else keeps its traceback (a programming error is not bad input)."""
    try:
        yield
    except kinds or (ConfigError,) as e:
        fail(e, code)
