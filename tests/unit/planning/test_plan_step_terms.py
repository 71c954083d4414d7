"""docs/planning.md's command: the plan prints the step's peak as named terms under each rank (summing to
the step phase it prints) and, on a GPU with allocator headroom, the reserved line."""

from __future__ import annotations

import json

from megaframe.plan import main
from megaframe.planning.devices import ALLOC_HEADROOM

ARGS = [
    "data=synthetic",
    "model=llama3_8b",
    "model.num_layers=2",
    "train.precision=bf16",
    "train.fused_head_loss=false",
    "optim.zero=3",
    "+world_size=8",
    "train.micro_batch_size=2",
    "train.global_batch_size=16",
    "+device=H100",
]


def test_the_plan_prints_the_step_terms_and_the_reserved_line(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main([*ARGS, f"+plan_json={out}"]) == 0
    text = capsys.readouterr().out
    step = next(line for line in text.splitlines() if line.strip().startswith("step = "))
    assert "logits/loss transient" in step and "zero3 gathered: output unit" in step, step
    d = json.loads(out.read_text())
    rank = d["ranks"][0]
    assert sum(rank["step_terms"].values()) == rank["phases"]["step"]
    assert d["reserved_bytes"] == int(d["peak_bytes"] * (1 + ALLOC_HEADROOM)) > d["peak_bytes"]
    assert "reserved on H100" in text and "allocator headroom 3 %" in text
