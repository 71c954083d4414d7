"""A pipeline layout the executor cannot run is refused by the config checks (exit 2, one line, before any
rank starts), because they build every rank's schedule as the executor does; the planner says the same
line instead of a traceback. The layouts that do run are proved equal to one process in
tests/distributed/pipeline/test_pipeline_equivalence.py (zbv with a 0-layer middle stage among them)."""

from __future__ import annotations

import sys

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.pipeline.partition import check_runnable
from tests.e2e.helpers import run

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
ZBV = ["data=synthetic", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv"]
MOE_RECOMPUTE = ["model=moe_tiny", "train.global_batch_size=12", "train.recompute=full"]


@pytest.mark.parametrize(
    "over,words",
    [
        (ZBV + ["parallel.pp_layout=[4,0,0,0]"], "leaves pipeline rank 1"),
        (
            [
                "data=synthetic",
                "parallel.pp=3",
                "model.num_layers=4",
                "parallel.pp_layout=[4,0,0]",
                "train.global_batch_size=12",
            ],
            "leaves pipeline rank 1",
        ),
        (ZBV + MOE_RECOMPUTE, "train.recompute=full"),
        (
            ["data=synthetic", "parallel.pp=2", "parallel.pp_schedule=zb_h1"] + MOE_RECOMPUTE,
            "train.recompute=full",
        ),
        (
            ["data=synthetic", "parallel.pp=2", "parallel.pp_schedule=zb_h1", "train.recompute=op_selective"],
            "train.recompute=op_selective",
        ),
    ],
    ids=[
        "zbv-rank-without-layers",
        "1f1b-middle-rank-without-layers",
        "zbv-moe-recompute-full",
        "zb_h1-moe-recompute-full",
        "zb_h1-recompute-op_selective",
    ],
)
def test_a_layout_the_executor_cannot_run_is_refused_at_load(over, words):
    world = 3 if "parallel.pp=3" in over else 2
    with pytest.raises(ConfigError) as info:
        load_config(over, world_size=world)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_the_layouts_that_run_are_accepted():
    """The controls: a 0-layer middle stage under zbv (now run by the executor), the same under interleaved,
    zb_h1 with a 0-layer last stage, and zbv + MoE without full recompute."""
    load_config(ZBV + ["parallel.pp_layout=[2,0,1,1]"], world_size=2)
    load_config(
        ["data=synthetic", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_layout=[2,0,1,1]"], world_size=2
    )
    load_config(
        ["data=synthetic", "parallel.pp=2", "parallel.pp_schedule=zb_h1", "parallel.pp_layout=[4,0]"],
        world_size=2,
    )
    load_config(ZBV + ["model=moe_tiny", "train.global_batch_size=12"], world_size=2)


def test_check_runnable_builds_every_ranks_schedule():
    """The schedule builder's own refusals surface through the check (the same code path as the executor)."""
    with pytest.raises(ValueError, match="multiple of parallel.pp"):
        check_runnable("interleaved", 2, 2, 3)
    check_runnable("zbv", 4, 2, 8, counts=[1, 1, 1, 1, 1, 1, 1, 1])


def test_planner_refuses_a_rank_without_layers_in_one_line():
    # a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the refusal
    res = run(
        [sys.executable, "-m", "megaframe.plan", *ZBV, "+world_size=2", "parallel.pp_layout=[4,0,0,0]"],
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "leaves pipeline rank 1" in res.stderr, res.stderr[-2000:]
