"""The experts' layout keys refused in one line that names the field at fault (exit 2 from train.py and
plan): ep and etp against the experts and the ranks they fold over, dispatch by node against capacity and
the nodes, the router's choices, MoE under tp without sp, the overlapped pipeline kinds' limits."""

from __future__ import annotations

import pytest

from tests.unit.config.test_config import one_line_error


@pytest.mark.parametrize(
    "overrides,world,names",
    [
        (["model=moe_tiny", "model.moe_top_k=9"], 1, ["model.moe_top_k", "model.num_experts"]),
        (["model=moe_tiny", "parallel.ep=3"], 3, ["parallel.ep", "model.num_experts"]),
        (["model=moe_tiny", "parallel.ep=4"], 2, ["parallel.ep=4", "tp x cp x dp = 1 x 1 x 2 = 2"]),
        (
            ["model=moe_tiny", "parallel.ep=4", "parallel.tp=2", "parallel.sp=true"],
            2,
            ["parallel.ep=4", "tp x cp x dp = 2 x 1 x 1 = 2"],
        ),
        (
            ["model=moe_tiny", "parallel.ep=4", "parallel.cp=2"],
            2,
            ["parallel.ep=4", "tp x cp x dp = 1 x 2 x 1"],
        ),
        (
            ["model=moe_tiny", "parallel.ep=2", "parallel.etp=2"],
            2,
            ["parallel.etp=2", "must divide tp x cp x dp"],
        ),
        (["model=moe_tiny", "parallel.etp=0"], 1, ["parallel.etp=0"]),
        (["parallel.etp=2"], 2, ["parallel.etp=2", "model.num_experts"]),
        (["model=moe_tiny", "parallel.etp=2", "model.moe_ffn_hidden_size=63"], 2, ["parallel.etp=2", "63"]),
        (
            ["model=moe_tiny", "parallel.ep=2", "optim.zero=1", "optim.shard_group_size=1"],
            4,
            ["optim.shard_group_size=1", "4 HSDP replicas", "data-parallel size", "= 2"],
        ),
        (["parallel.ep=2"], 2, ["parallel.ep", "model.num_experts"]),
        (
            ["model=moe_tiny", "parallel.ep=2", "parallel.ep_dispatch=node", "model.moe_capacity_factor=1.0"],
            2,
            ["parallel.ep_dispatch=node", "model.moe_capacity_factor=1.0"],
        ),
        (
            ["model=moe_tiny", "parallel.ep=4", "parallel.ep_dispatch=node", "parallel.ranks_per_node=3"],
            4,
            ["parallel.ranks_per_node=3", "same ranks on each of its nodes"],
        ),
        (
            ["model=moe_tiny", "parallel.ep=2", "parallel.etp=2", "parallel.ep_dispatch=node"],
            4,
            ["parallel.ep_dispatch=node", "parallel.etp=2"],
        ),
        (["parallel.ranks_per_node=-1"], 1, ["parallel.ranks_per_node=-1"]),
        (["parallel.ep_dispatch=deepep"], 1, ["parallel.ep_dispatch"]),
        (["model=moe_tiny", "model.moe_router_score=relu"], 1, ["model.moe_router_score"]),
        (["model=moe_tiny", "model.moe_capacity_factor=0"], 1, ["model.moe_capacity_factor"]),
        (["model=moe_tiny", "parallel.tp=2"], 2, ["parallel.tp=2", "parallel.sp=true"]),
        # a forward beside a backward: no recomputed forward inside the backward, no ZeRO-3 gathers in it
        (
            ["model=moe_tiny", "parallel.pp_schedule=1f1b_overlap", "train.recompute=selective"],
            1,
            ["parallel.pp_schedule=1f1b_overlap", "train.recompute=selective"],
        ),
        (
            ["model=moe_tiny", "parallel.pp_schedule=1f1b_overlap", "optim.zero=3"],
            2,
            ["parallel.pp_schedule=1f1b_overlap", "optim.zero=3"],
        ),
        (
            ["model=moe_tiny", "parallel.pp_schedule=1f1b_overlap", "parallel.pp=2"],
            2,
            ["parallel.pp_schedule=1f1b_overlap", "interleaved_overlap"],
        ),
    ],
)
def test_expert_layout_errors_name_the_field(overrides, world, names):
    msg = one_line_error(["model=gpt_tiny", "data=synthetic", *overrides], world_size=world)
    for n in names:
        assert n in msg, msg
