"""Measured search: `+search=true +measure=K` trains the top K layouts a few steps on this machine (torchrun,
gloo, CPU) and prints the measured ranking beside the predicted one; bad measure settings exit 2."""

from __future__ import annotations

import re
import sys

import pytest

from tests.e2e.helpers import run

pytestmark = pytest.mark.e2e

SMALL = [
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=64",
    "model.vocab_size=256",
    "train.global_batch_size=8",
    "+world_size=2",
    "+device=cpu",
    "+search=true",
    "+top=3",
]
ROW = re.compile(r"^\s+#(\d)\s+#(\d)\s+(tp=.*?)\s+([\d.]+)s\s+([\d.]+)s\s+[+-][\d.]+%$")


def test_measured_ranking_printed_beside_the_predicted(tmp_path):
    res = run([sys.executable, "-m", "megaframe.plan", *SMALL, "+measure=2", "+measure_steps=4"], timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout.split("measured (4 steps each")[1]
    rows = [ROW.match(line) for line in out.splitlines()]
    rows = [m for m in rows if m]
    assert [int(m[1]) for m in rows] == [1, 2], out
    assert sorted(int(m[2]) for m in rows) == [1, 2]  # the predicted #1 and #2, each measured
    measured = [float(m[4]) for m in rows]
    assert measured == sorted(measured) and measured[0] > 0  # ordered by the measured step time
    assert "run the measured #1 with: parallel.tp=" in out


@pytest.mark.parametrize(
    "args, needle",
    [(["+measure=2", "+measure_steps=2"], "+measure_steps=2"), (["+measure=-1"], "+measure=-1")],
)
def test_bad_measure_settings_exit_2(args, needle):
    res = run([sys.executable, "-m", "megaframe.plan", *SMALL, *args], timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr


def test_measure_needs_search():
    res = run(
        [sys.executable, "-m", "megaframe.plan", *[a for a in SMALL if a != "+search=true"], "+measure=2"],
        timeout=120,
    )
    assert res.returncode == 2 and "+search=true" in res.stderr, res.stderr
