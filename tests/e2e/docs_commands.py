"""The shell commands of README.md and docs/*.md, read the way tests/e2e/test_docs_commands.py runs them.

Every line of a fenced ```bash block is a command (a trailing backslash continues it). Tags in its comment
say how the suite checks it (docs/README.md explains them to writers):
  (none)                  run, in page order, with small overrides appended (tiny model, few steps)
  [exit N]                run exactly as written, nothing appended (a user's outcome cannot hang on the
                          appendix); it must exit with code N (a refusal the page shows)
  [tested-by: FILE::TEST] an existing test runs what it shows: the test must exist
  [gpu] [cluster] [slow]  not run (needs a GPU / a Slurm cluster or several nodes / minutes of benchmark):
                          bash -n, and its Hydra overrides parsed and checked against the schema
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
TAG = re.compile(r"\[(gpu|cluster|slow|exit \d+|tested-by: *[^\]\s]+)\]")
SKIP_TAGS = {"gpu", "cluster", "slow"}
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MAX_STEPS = 8
"""train.max_steps of a page's train command is capped here. Every page's train command sets its own short
train.max_steps and warmup (what a reader copying it runs; tests/unit/test_docs_as_written.py checks it);
the cap only makes the suite's run shorter still (a page writes the steps its later commands need, e.g. a
checkpoint at step 2, with values at most this)."""


@dataclass
class Command:
    page: str
    line: int
    code: str  # the shell text, comment removed, continuation lines joined
    tags: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return not any(t in SKIP_TAGS or t.startswith("tested-by") for t in self.tags)

    @property
    def expected_exit(self) -> int:
        return next((int(t.split()[1]) for t in self.tags if t.startswith("exit ")), 0)

    @property
    def tested_by(self) -> str | None:
        return next((t.split(":", 1)[1].strip() for t in self.tags if t.startswith("tested-by")), None)


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment): a `#` at the start or after whitespace, outside quotes, starts the comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1 :]
    return line, ""


def blocks(page: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every ```bash block of the page."""
    out, cur, start = [], None, 0
    for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        stripped = line.strip()
        if cur is None and stripped == "```bash":
            cur, start = [], n + 1
        elif cur is not None and stripped.startswith("```"):
            out.append((start, cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def commands(page: str) -> list[Command]:
    out = []
    for start, lines in blocks(page):
        pending, first, notes = "", 0, ""
        for n, line in enumerate(lines, start):
            code, comment = split_comment(line)
            if not pending:
                first = n
            notes += comment
            if code.rstrip().endswith("\\"):
                pending += code.rstrip()[:-1] + " "
                continue
            text = (pending + code).strip()
            pending = ""
            if text:
                out.append(Command(page, first, text, TAG.findall(notes)))
            notes = ""
    return out


def tokens(cmd: Command) -> list[str]:
    """The command's words after any leading VAR=value environment settings."""
    words = shlex.split(cmd.code)
    while words and ENV_ASSIGN.match(words[0]):
        words.pop(0)
    return words


def hydra_overrides(cmd: Command) -> tuple[str, list[str]]:
    """(tool, its key=value words) for the commands that take Hydra overrides; ("", []) for others."""
    words = tokens(cmd)
    for tool in (
        "train.py",
        "pretrain.sbatch",
        "megaframe.plan",
        "megaframe.evaluate",
        "megaframe.data.prepare",
        "import_hf.py",
        "sweep.py",
    ):
        idx = next((i for i, w in enumerate(words) if w.endswith(tool)), None)
        if idx is not None:
            rest = words[idx + 1 :]
            rest = rest[: rest.index("--")] if "--" in rest else rest  # sweep.py: what follows goes to sbatch
            return tool, [w for w in rest if "=" in w and not w.startswith("-")]
    return "", []


def small_overrides(cmd: Command) -> list[str]:
    """What a command gets appended to run in seconds: a train command the tiny model and batch of the e2e
    tests for every key it does not set itself, and train.max_steps capped at MAX_STEPS; prepare one worker.
    An [exit N] command gets nothing: the appended batch once made a refusal the page promised (a user,
    without it, trained on)."""
    from tests.e2e.helpers import TINY

    if cmd.expected_exit:
        return []
    tool, over = hydra_overrides(cmd)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in over}
    if tool == "megaframe.data.prepare":  # worker processes cost more than they save on a small corpus
        return [] if "data.num_workers" in keys else ["data.num_workers=1"]
    if tool != "train.py":
        return []
    extra = [o for o in TINY if o.split("=", 1)[0] not in keys]
    if "model" in keys:  # a preset's own grouping stands: GPT-2's family has none (its check refuses GQA)
        extra = [o for o in extra if not o.startswith("model.num_query_groups=")]
    steps = [int(o.split("=", 1)[1]) for o in over if o.split("=", 1)[0].lstrip("+") == "train.max_steps"]
    if not steps or steps[-1] > MAX_STEPS:
        extra.append(f"train.max_steps={MAX_STEPS}")
    return extra
