"""docs/moe.md's plans (Qwen3-30B-A3B on 64 H100, Qwen3-235B-A22B and DeepSeek-V3 in their published
layouts) run as the page writes them, and the page's prose quotes their figures: the largest rank's memory
and the step time, rounded as written. A change to the planner that moves them fails here until the page
says the new figures."""

from __future__ import annotations

import re

import pytest

from megaframe.plan import main
from tests.e2e.docs_commands import ROOT, commands, tokens

PAGE = "docs/moe.md"


def _plans() -> list:
    return [c for c in commands(PAGE) if tokens(c)[:3] == ["python", "-m", "megaframe.plan"]]


def _prose_after(line: int) -> str:
    """The page's text from the command's line to the next heading: where it describes that plan."""
    rest = (ROOT / PAGE).read_text().splitlines()[line:]
    end = next((i for i, text in enumerate(rest) if text.startswith("#")), len(rest))
    return " ".join(rest[:end])


@pytest.mark.parametrize("cmd", _plans(), ids=lambda c: c.where)
def test_the_page_quotes_its_plans(cmd, capsys):
    assert main(tokens(cmd)[3:]) == 0
    out = capsys.readouterr().out
    memory = float(re.search(r"needs ([\d.]+) GiB", out).group(1))
    step = float(re.search(r"step time on [^:]+: ([\d.]+) s", out).group(1))
    prose = _prose_after(cmd.line)
    assert f"{memory:.1f} GiB" in prose, (cmd.where, memory)
    assert f"{step:.1f} s a step" in prose, (cmd.where, step)
