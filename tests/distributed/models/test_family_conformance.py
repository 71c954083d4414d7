"""Every registered family (megaframe/models/registry.py) on its tiny preset trains under tp2.sp.pp2 (its
blocks split over heads and the sequence, cut between two pipeline stages, the tied embedding on both ends
where it ties) exactly like one process: both steps' losses (the second after an update) and step-1 grads.
Not the weights: Adam turns float32 reduction-order noise in a near-zero grad into a step of up to lr.
The one-process half of the conformance: tests/unit/models/test_family_conformance.py."""

import pytest

from megaframe.models.registry import FAMILIES
from tests.distributed.cases import TINY, tiny_config, train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts

pytestmark = pytest.mark.distributed

STEPS = 2
# cases.TINY's batch and run settings, the preset's own heads and widths (GPT-2 has no GQA)
BASE = [o for o in TINY if not o.startswith(("model.num_attention_heads", "model.num_query_groups"))]
BASE = [o for o in BASE if not o.startswith(("model.hidden_size", "model.ffn_hidden_size"))]


_reference: dict = {}


def reference(pool, family: str, same: list[str]) -> dict:
    """One process on the family's tiny preset under `same` (the options that change the model or data),
    run once per module: the tp2.sp.pp2 test and the layouts of the same options share it."""
    key = (family, *same)
    if key not in _reference:
        model = [f"model={FAMILIES[family].tiny}"]
        _reference[key] = pool.run(train_and_report, 1, model + same, STEPS, None, False, BASE)[0]
    return _reference[key]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_sp_pp2_matches_one_process(pool, name):
    model = [f"model={FAMILIES[name].tiny}"]
    ref = reference(pool, name, [])
    over = model + ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"]
    got = pool.run(train_and_report, 4, over, STEPS, None, False, BASE, tp=2, pp=2)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert len(rel) == STEPS and max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")


# Layouts beyond tp2.sp.pp2 against one process: (name, ranks, pool mesh, overrides). LAYOUTS run for the
# MoE families with layouts of their own to prove (qwen3_moe; mixtral's: tests/distributed/model/test_moe.py)
# and for the families whose block is their own (MLA's K and V of two widths through the cp kernels, document
# masks, ep with shared experts and group-limited routing); the folded expert layouts (ep over tp, etp, HSDP
# with ep) for every family whose tiny preset has experts. Few steps at the tiny presets' dims.
SP = ["parallel.sp=true"]
LAYOUTS = [
    ("tp2.sp", 2, dict(tp=2), ["parallel.tp=2", *SP]),
    ("ep2", 2, dict(ep=2), ["parallel.ep=2"]),
    ("ep4", 4, dict(ep=4), ["parallel.ep=4"]),
    ("pp2", 2, dict(pp=2), ["parallel.pp=2"]),
    ("vpp2", 2, dict(pp=2), ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"]),
    ("cp2.ring.docs", 2, dict(cp=2), ["parallel.cp=2", "parallel.cp_comm=ring", "data.document_mask=true"]),
    ("cp2.allgather", 2, dict(cp=2), ["parallel.cp=2", "parallel.cp_comm=allgather"]),
    ("zero3.dp2", 2, {}, ["optim.zero=3"]),
]
FOLDED_LAYOUTS = [
    ("tp2.ep2", 2, dict(tp=2, ep=2), ["parallel.tp=2", *SP, "parallel.ep=2"]),  # ep over the tp pair
    ("etp2", 2, dict(etp=2), ["parallel.etp=2"]),
    ("hsdp2.ep2", 4, dict(ep=2, shard=2), ["parallel.ep=2", "optim.zero=1", "optim.shard_group_size=2"]),
]
# every family whose tiny preset has experts (a new MoE family gets the folded layouts without an edit)
MOE_FAMILIES = [n for n, f in FAMILIES.items() if tiny_config([f"model={f.tiny}"], 1, BASE).model.num_experts]
OWN_BLOCK = [name for name, spec in FAMILIES.items() if spec.block is not FAMILIES["llama"].block]
CASES = [(f, *c) for f in ["qwen3_moe", *OWN_BLOCK] if f in FAMILIES for c in LAYOUTS]
CASES += [(f, *c) for f in MOE_FAMILIES for c in FOLDED_LAYOUTS]


@pytest.mark.parametrize("family,layout,n,kw,over", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_layout_matches_one_process(pool, family, layout, n, kw, over):
    model = [f"model={FAMILIES[family].tiny}"]
    # the reference with the same options where an override changes the model or data (vpp2's four
    # layers, document masks)
    ref = reference(pool, family, [o for o in over if o.startswith(("model.", "data."))])
    got = pool.run(train_and_report, n, model + over, STEPS, None, False, BASE, **kw)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    print(f"{family} {layout}: max relative loss difference {max(rel):.2e}")
    assert len(rel) == STEPS and max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
