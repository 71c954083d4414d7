"""The layout search: candidates are exactly the layouts validate() accepts, the search's memory agrees
with the exact per-rank planner, the step-time model's parts follow its stated rules, and the command
prints a ranked top list with reasons."""
from __future__ import annotations

import dataclasses

import pytest

from megaframe.config import load_config
from megaframe.plan import main
from megaframe.planning.devices import DEVICES, get_device
from megaframe.planning.estimate import plan_layout
from megaframe.planning.search import Layout, candidates, layout_config, memory, search, step_time

SMALL = ["data=synthetic", "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=8",
         "model.num_query_groups=4", "model.ffn_hidden_size=128", "model.seq_length=64", "model.vocab_size=256",
         "train.global_batch_size=16"]


@pytest.fixture(scope="module")
def cfg():
    return load_config(SMALL, world_size=1, check_data=False)


def test_candidates_are_valid_and_cover_the_axes(cfg):
    lays = candidates(cfg, 8, 8)
    assert {(x.tp, x.pp) for x in lays} >= {(1, 1), (2, 2), (4, 2), (2, 4), (1, 4)}
    assert not any(x.tp == 8 for x in lays)  # 4 kv heads do not split 8 ways
    assert all(x.tp * x.cp * x.pp * x.dp == 8 for x in lays)
    assert any(x.vpp == 2 for x in lays) and {x.recompute for x in lays} == {"none", "selective", "full"}


@pytest.mark.parametrize("lay", [Layout(1, 1, 1, 4, 1, 1, 2, "none"), Layout(2, 2, 1, 1, 1, 1, 1, "none"),
                                 Layout(2, 2, 2, 1, 1, 0, 2, "full"), Layout(1, 4, 1, 1, 1, 1, 1, "selective")])
def test_search_memory_matches_the_exact_planner(cfg, lay):
    exact = plan_layout(layout_config(cfg, lay), 4, None)
    worst = max(r.total_bytes for r in exact.ranks)
    assert abs(memory(cfg, lay) - worst) / worst < 0.05, (memory(cfg, lay), worst)


def test_step_time_parts_follow_the_model(cfg):
    h100 = DEVICES["H100"]
    base = step_time(cfg, Layout(1, 1, 1, 8, 1, 1, 2, "none"), h100, 8)
    assert base["tp"] == base["pp"] == base["bubble"] == 0 and base["dp"] > 0
    full = step_time(cfg, Layout(1, 1, 1, 8, 1, 1, 2, "full"), h100, 8)
    assert full["compute"] > base["compute"]
    pp = step_time(cfg, Layout(1, 2, 1, 4, 1, 1, 2, "none"), h100, 8)  # 2 micro-batches: bubble 1/3
    assert pp["bubble"] == pytest.approx(pp["compute"] / (1 - 1 / 3) - pp["compute"])
    tp = step_time(cfg, Layout(8, 1, 1, 1, 1, 1, 2, "none"), h100, 8)
    assert tp["tp"] > 0 and tp["dp"] == 0


def test_search_command_prints_a_ranked_top(capsys):
    assert main([*SMALL, "+world_size=8", "+device_memory_gb=80", "+search=true", "+device=A100", "+top=3"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts" in out and "#2 loses to #1 by +" in out and "run #1 with: parallel.tp=" in out
    assert main([*SMALL, "+world_size=8", "+search=true", "+device=Z80"]) == 2


def test_a_tiny_memory_drops_every_layout(cfg):
    ests, n, dropped = search(cfg, 4, DEVICES["H100"], 1e3)
    assert not ests and n == dropped > 0
    assert get_device("h200").memory_gb == 141 and dataclasses.replace(get_device("B200"), efficiency=0.4).efficiency == 0.4
