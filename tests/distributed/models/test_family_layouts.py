"""Qwen3 (per-head q/k norms, a head dim apart from hidden/heads, tied embeddings) and llama3-scaled RoPE
train like one process under tp (with and without sp: the q/k norm weights see only their rank's heads), pp
(the tied embedding on both pipeline ends), ZeRO-3 dp2, cp2 and tp2·dp2 under ZeRO-1: losses, step-1 grads,
final weights."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close

pytestmark = pytest.mark.distributed

STEPS = 3
QWEN3 = ["model=qwen3_tiny"]  # cases.TINY's dims (8 heads of kv_channels 48 over hidden 64) on top
LLAMA3 = [
    "model.rope_scaling.rope_type=llama3",
    "model.rope_scaling.factor=8",
    "model.rope_scaling.original_max_position_embeddings=8",
]  # seq 32: 4x past the "pretraining" context
# (name, base, ranks, pool layout, overrides)
CASES = [
    ("qwen3-tp2", QWEN3, 2, dict(tp=2), ["parallel.tp=2"]),
    ("qwen3-tp2-sp", QWEN3, 2, dict(tp=2), ["parallel.tp=2", "parallel.sp=true"]),
    ("qwen3-pp2", QWEN3, 2, dict(pp=2), ["parallel.pp=2"]),
    ("qwen3-zero3-dp2", QWEN3, 2, {}, ["optim.zero=3"]),
    ("qwen3-cp2", QWEN3, 2, dict(cp=2), ["parallel.cp=2"]),
    # the q/k norms' tp-summed grads then reduced and sharded over dp by ZeRO-1
    ("qwen3-tp2-dp2-sp-zero1", QWEN3, 4, dict(tp=2), ["parallel.tp=2", "parallel.sp=true", "optim.zero=1"]),
    ("llama3-rope-tp2-sp", LLAMA3, 2, dict(tp=2), ["parallel.tp=2", "parallel.sp=true"]),
]
_reference: dict = {}


def reference(pool, base: list[str]) -> dict:
    key = tuple(base)
    if key not in _reference:
        _reference[key] = pool.run(train_and_report, 1, base, STEPS)[0]
    return _reference[key]


@pytest.mark.parametrize("name,base,n,layout,over", CASES, ids=[c[0] for c in CASES])
def test_layout_matches_one_process(pool, name, base, n, layout, over):
    ref = reference(pool, base)
    got = pool.run(train_and_report, n, base + over, STEPS, **layout)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])
    if base is QWEN3:
        assert "layers.0.attn.q_norm.weight" in got["grads"]
