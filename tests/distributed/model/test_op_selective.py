"""train.recompute=op_selective (torch's selective activation checkpointing per block, op-level policy):
the same losses and grads as one process without recompute at tp2·sp, pp2, ZeRO-3 dp2 and cp2; fewer saved
bytes than recompute=none and more than full on real CPU tensors; and the planner's meta count of a block
equal to what the trainer's block keeps on CPU."""

import pytest
import torch

from megaframe.parallel.virtual import virtual_mesh
from megaframe.planning.memory.activations import chunk_activation_bytes
from tests.distributed.cases import tiny_config, train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts
from tests.distributed.moe_cases import MOE
from tests.distributed.zero_cases import run_steps
from tests.forms import build_model

pytestmark = pytest.mark.distributed

STEPS = 3
OP = "train.recompute=op_selective"
_reference: dict = {}


def _reference_run(pool, fn):
    if fn not in _reference:
        _reference[fn] = pool.run(fn, 1, [], STEPS)[0]
    return _reference[fn]


def _assert_matches(got, ref):
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")


# (name, ranks, tp, pp, overrides, runner): the runner is the one its layout's other tests use
LAYOUTS = [
    ("one-process", 1, 1, 1, [], train_and_report),
    ("tp2-sp", 2, 2, 1, ["parallel.tp=2", "parallel.sp=true"], train_and_report),
    ("pp2", 2, 1, 2, ["parallel.pp=2"], train_and_report),
    ("zero3-dp2", 2, 1, 1, ["optim.zero=3"], run_steps),
    ("cp2", 2, 1, 1, ["parallel.cp=2"], train_and_report),
]


@pytest.mark.parametrize("name,n,tp,pp,extra,fn", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_op_selective_matches_one_process_without_recompute(pool, name, n, tp, pp, extra, fn):
    ref = _reference_run(pool, fn)
    cp = 2 if "parallel.cp=2" in extra else 1
    got = pool.run(fn, n, extra + [OP], STEPS, tp=tp, pp=pp, cp=cp)[0]
    _assert_matches(got, ref)


def _cpu_model(recompute: str, device: str = "cpu", layers: int = 2, extra: tuple = ()):
    cfg = tiny_config([f"train.recompute={recompute}", f"model.num_layers={layers}", *extra], 1)
    model = build_model(cfg, virtual_mesh(1, 1, 1, device=device))
    model.train()
    return model


def _per_block(recompute: str, device: str = "cpu", extra: tuple = ()) -> int:
    """One block's saved bytes for a micro-batch of 2 as the planner measures it (search._act_per_layer):
    a 2-layer minus a 1-layer model, through the trainer's forward_chunk. On meta the fused attention's
    stand-in; on CPU the real kernels."""
    fused = device == "meta"
    two, one = (_cpu_model(recompute, device, n, extra) for n in (2, 1))
    return chunk_activation_bytes(two, 0, 2, fused_attention=fused) - chunk_activation_bytes(one, 0, 2, fused)


def test_op_selective_keeps_fewer_bytes_than_none_and_more_than_full():
    """Measured on real CPU tensors (autograd's saved tensors plus the policy's cache). A Llama block keeps
    its input, [q|k|v], the attention output and log-sum-exp, and [gate|up] (model/recompute.py)."""
    torch.manual_seed(0)
    got = {r: _per_block(r) for r in ("none", "op_selective", "full")}
    cfg = tiny_config([], 1).model
    s, b, d, f, e = cfg.seq_length, 2, cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    kv = cfg.num_query_groups * e
    # per block, fp32: input, qkv output, attention output and its lse [B, H, S], the [gate | up] output
    lse = b * cfg.num_attention_heads * s
    want = 4 * (s * b * d + s * b * (d + 2 * kv) + s * b * d + lse + s * b * 2 * f)
    assert got["op_selective"] == want, (got, want)
    assert got["full"] < got["op_selective"] < got["none"], got


# an MoE block (4 experts, top-2): dropless, the rows it keeps grow with the tokens times top-k alone, so the
# planner's balanced routing and the trainer's real one keep the same bytes (the ids pick real experts)
MOE_BLOCK = tuple(MOE)


@pytest.mark.parametrize(
    "recompute,extra", [("op_selective", ()), ("none", MOE_BLOCK)], ids=["op_selective", "moe"]
)
def test_planner_counts_a_block_as_the_trainer_keeps_it(recompute, extra):
    """The planner's meta forward (attention stand-in) and a real CPU block keep the same bytes."""
    assert _per_block(recompute, "meta", extra) == _per_block(recompute, extra=extra)
