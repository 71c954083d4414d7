"""The zero-bubble split backward (pipeline/split.py): B (input grad) then W (weight grads) gives exactly the
unsplit backward's grads, for every layer kind with weights: linears with and without bias, RMSNorm and
LayerNorm, the embedding and learned positions (first stage: all at W), the head with its fused CE and the
tied head (last stage), MoE experts (grouped and loop) and router, under full and selective recompute;
and B leaves every weight grad untouched."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from megaframe.config import load_config
from megaframe.model.gpt import GPT
from megaframe.parallel.mesh import single_process_mesh
from megaframe.pipeline.partition import Stage
from megaframe.pipeline.split import backward_input, backward_weight, saving

SMALL = [
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=48",
    "model.seq_length=16",
    "model.vocab_size=64",
]
MODELS = {
    "gpt_tiny": ["model.num_query_groups=2"],
    "gpt2_tiny": ["model=gpt2_tiny", "model.num_query_groups=null"],
    "moe_tiny": ["model=moe_tiny", "model.num_query_groups=2", "model.moe_ffn_hidden_size=24"],
}
WHERE = {"first": (True, False), "middle": (False, False), "last": (False, True)}


@functools.lru_cache(maxsize=None)
def _cfg(name: str):
    return load_config(
        MODELS[name] + SMALL, world_size=1, check_data=False
    ).model  # a Hydra compose: once each


def _model(name: str, where: str, recompute: str) -> GPT:
    cfg = _cfg(name)
    first, last = WHERE[where]
    model = GPT(cfg, single_process_mesh(), stage=Stage(((0, 1),), first, last), recompute=recompute)
    model.init_weights(seed=3)
    return model.train()


def _run(model: GPT, split: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    ids_BS = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    x_SBD = None if model.stage.first else torch.randn(cfg.seq_length, 2, cfg.hidden_size, generator=g)
    if x_SBD is not None:
        x_SBD.requires_grad_()
    with saving() if split else contextlib.nullcontext():
        out = model.forward_chunk(0, x_SBD, ids_BS, ids_BS.roll(-1, 1))
    root = out.float().sum() / 100 if model.stage.last else out
    grad = None if model.stage.last else torch.randn(out.shape, generator=g)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    if not split:
        root.backward(grad)
        return (None if x_SBD is None else x_SBD.grad), {n: p.grad for n, p in model.named_parameters()}
    gx, pending = backward_input(root, grad, x_SBD, params)
    assert all(p.grad is None for p in params), "B must not touch the weights' grads"
    # B releases what W does not read (activations, attention): off the first stage, in every model
    assert model.stage.first or model.recompute_blocks or pending.released > 0, pending.released
    del root, out
    backward_weight(pending)
    return gx, {n: p.grad for n, p in model.named_parameters()}


# every model at every kind of stage; recompute on the dense model's middle stage
CASES = [(n, w, "none") for n in MODELS for w in WHERE] + [
    ("gpt_tiny", "middle", r) for r in ("full", "selective")
]


@pytest.mark.parametrize("name,where,recompute", CASES, ids=["-".join(c) for c in CASES])
def test_b_then_w_equals_the_whole_backward(name, where, recompute):
    model = _model(name, where, recompute)
    gx_ref, ref = _run(model, split=False)
    gx, got = _run(model, split=True)
    if gx_ref is None:
        assert gx is None
    else:
        torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-7)
    for n, g in ref.items():
        if g is None:
            assert got[n] is None, n
            continue
        assert got[n] is not None, f"{n}: W gave no grad"
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_moe_loop_experts_split_exactly(monkeypatch):
    """The per-expert loop (no grouped GEMM) too."""
    import megaframe.model.moe.grouped as grouped

    monkeypatch.setattr(grouped, "grouped_supported", lambda x: False)
    model = _model("moe_tiny", "middle", "none")
    gx_ref, ref = _run(model, split=False)
    gx, got = _run(model, split=True)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-7)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7)
