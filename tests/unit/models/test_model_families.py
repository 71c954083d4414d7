"""Model families (megaframe/models): every preset in conf/model/ belongs to exactly one registered family,
the one its model.family names; the family's parameter counter equals `sum(p.numel())` of the built (meta)
model for every preset, on one process and on each rank of tp / pp / ep cuts (what the planner reads); MFU's
FLOP counter is the family's. What each family must do on its tiny preset: test_family_conformance.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaframe.config import load_config
from megaframe.model.gpt import GPT
from megaframe.parallel.mesh import single_process_mesh
from megaframe.parallel.virtual import virtual_mesh
from megaframe.planning.candidate import Layout, stage_params
from megaframe.training.metrics import flops_per_token
from tests.forms import build_model

ROOT = Path(__file__).resolve().parents[3]
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


def preset_config(preset: str, *more: str, world: int = 1):
    return load_config([f"model={preset}", "data=synthetic", *more], world_size=world, check_data=False)


def test_every_preset_has_one_family():
    from megaframe.models.registry import FAMILIES

    owners = {p: [f.name for f in FAMILIES.values() if p in f.presets] for p in PRESETS}
    assert all(len(v) == 1 for v in owners.values()), owners
    listed = {p for f in FAMILIES.values() for p in f.presets}
    assert listed <= set(PRESETS), listed - set(PRESETS)  # a spec names no preset that is not there


@pytest.mark.parametrize("preset", PRESETS)
def test_param_counter_equals_the_built_model(preset):
    from megaframe.models.registry import preset_family

    m = preset_config(preset).model
    spec = preset_family(preset)
    assert m.family == spec.name
    model = GPT(m, single_process_mesh("cpu"), param_device="meta", block=spec.block)
    assert spec.total_params(m) == sum(p.numel() for p in model.parameters())
    assert flops_per_token(m) == spec.flops_per_token(m)


# per-rank counts under cuts: (preset, tp, pp, ep); the
# biased and tied presets catch what the planner left out
CUTS = [
    ("gpt2_tiny", 2, 2, 1),
    ("gpt_tiny", 2, 2, 1),
    ("qwen3_tiny", 2, 2, 1),
    ("moe_tiny", 2, 1, 2),
    ("gpt2_tiny", 1, 2, 1),
    ("qwen3_tiny", 1, 4, 1),
    # dense first blocks on the first stage, the MTP depth's experts on the last
    ("deepseek_v3_tiny", 1, 2, 2),
    ("deepseek_v3_tiny", 2, 2, 2),
    # an uneven split: the dense block and two MoE blocks on the first rank
    ("deepseek_v3_tiny", 1, 2, 2, (3, 1)),
]


@pytest.mark.parametrize(
    "preset,tp,pp,ep,layout", [c if len(c) == 5 else (*c, ()) for c in CUTS], ids=lambda v: str(v)
)
def test_stage_counts_equal_each_rank(preset, tp, pp, ep, layout):
    world = tp * pp * ep
    cfg = preset_config(
        preset,
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        f"parallel.ep={ep}",
        f"parallel.sp={tp > 1}",
        f"train.global_batch_size={8 * ep}",
        *([f"parallel.pp_layout=[{','.join(map(str, layout))}]"] if layout else []),
        world=world,
    )
    lay = Layout(tp=tp, pp=pp, vpp=1, dp=ep, ep=ep, zero=0, micro_batch=1, recompute="none", pp_layout=layout)
    assert world == tp * pp * lay.dp
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            mesh = virtual_mesh(tp, pp, ep, tp_rank=tp_rank, pp_rank=pp_rank, device="meta", ep=ep)
            model = build_model(cfg, mesh)
            dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
            expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
            want = stage_params(cfg.model, lay, pp_rank == 0, pp_rank == pp - 1)
            assert (dense, expert) == want, (pp_rank, tp_rank)
