"""A block keeps for backward only what its backward reads: attention keeps v's own heads, not the whole
projection output it was cut from, and one pair of RoPE tables per chunk, not a bf16 cast per layer and per
q and k; the MoE gate keeps x as it came, not its fp32 copy.

Legend: S tokens, B micro-batch, H query heads, K kv heads, E head dim.

Once q and k are rotated (new tensors), a v that is still a view of the fused [q | k | v] output would keep
that whole output alive until backward (attention saves its inputs): (H + 2K) / K times v's bytes. The
counts below are autograd's saved storages in a real CPU forward (the planner's own counter,
planning/memory/activations.py), so they are what the planner charges too.
"""

from __future__ import annotations

import torch

from megaframe.config import load_config
from megaframe.model.parallelize import build_model_for
from megaframe.parallel.mesh import single_process_mesh
from megaframe.planning.memory import activations

S, D, H, K, E = 64, 128, 4, 1, 32
LLAMA = [
    "data=synthetic",
    "model=llama3_8b",
    "model.num_layers=2",
    f"model.hidden_size={D}",
    f"model.num_attention_heads={H}",
    f"model.num_query_groups={K}",
    "model.ffn_hidden_size=256",
    f"model.seq_length={S}",
    "model.vocab_size=256",
    "train.global_batch_size=1",
    "train.micro_batch_size=1",
    "train.precision=bf16",
    "train.device=cpu",
]


def _saved(model, run) -> dict[int, torch.Tensor]:
    """The distinct non-parameter storages autograd saves while run() does a forward, one tensor each."""
    counter = activations.SavedBytes(model.parameters())
    seen: dict[int, torch.Tensor] = {}

    def pack(t):
        key = activations._storage_key(t)
        if key not in counter.exclude:
            seen.setdefault(key, t)
        return counter.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return seen


def _model(overrides: list[str], device: str = "cpu"):
    cfg = load_config(overrides, world_size=1, check_data=False)
    torch.manual_seed(0)
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, single_process_mesh(device))
    return model.train()


def test_a_rotated_attention_keeps_v_not_the_whole_qkv_output():
    model = _model(LLAMA)
    # the outputs themselves, held: a key of a freed storage could come back as a later tensor's
    outputs: list[torch.Tensor] = []
    for i in ("0", "1"):
        model.layers[i].attn.qkv.register_forward_hook(lambda m, a, out: outputs.append(out))
    ids_BS = torch.randint(0, 256, (1, S))
    saved = _saved(model, lambda: model.forward_chunk(0, None, ids_BS, ids_BS))
    keys = {activations._storage_key(t) for t in outputs}
    assert len(keys) == 2 and not keys & set(saved)  # old code: both layers' [q | k | v] kept
    v_bytes = S * K * E * 2
    assert sum(1 for t in saved.values() if t.untyped_storage().nbytes() == v_bytes and t.shape[-1] == E) >= 2
    # one (cos, sin) pair in the blocks' dtype for the chunk; before, each layer cast two pairs of its own
    tables = [t for t in saved.values() if t.dim() == 4 and tuple(t.shape[1:3]) == (1, 1)]
    assert len(tables) == 2 and {t.dtype for t in tables} == {torch.bfloat16}, [t.shape for t in tables]


def test_mla_keeps_v_not_the_whole_k_nope_and_v_output():
    """DeepSeek-V3's MLA: k is a new tensor (the cat with the shared rotary key), so a view v would keep
    kv_b_proj's whole [k_nope | v] output. On meta, with the planner's stand-in for the fused kernel a GPU
    runs (CPU's math path copies v anyway)."""
    model = _model(["data=synthetic", "model=deepseek_v3_tiny", "train.precision=bf16"], "meta")
    outputs: list[torch.Tensor] = []
    model.layers["0"].attn.kv_b_proj.register_forward_hook(lambda m, a, out: outputs.append(out))
    ids_BS = torch.zeros(1, model.cfg.seq_length, dtype=torch.long, device="meta")
    with activations.FusedAttentionSizes(False, True):
        saved = _saved(model, lambda: model.forward_chunk(0, None, ids_BS, ids_BS))
    kept = [tuple(saved[k].shape) for k in {activations._storage_key(t) for t in outputs} & set(saved)]
    assert outputs and not kept, kept


def test_the_moe_gate_keeps_x_as_it_came_not_its_fp32_copy():
    """The router's fp32 GEMM (model/moe/router.py) keeps the bf16 x and casts it again in backward, as
    Megatron's router gating does: autograd would keep the fp32 copy (twice x's bytes a layer a micro-batch).
    Its output and both grads are F.linear's on the fp32 casts, bit for bit."""
    import torch.nn.functional as F

    from megaframe.model.moe.router import _Fp32Gate

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, D, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(8, D, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(64, 8, generator=gen)
    saved = _saved(torch.nn.Linear(1, 1), lambda: _Fp32Gate.apply(x, w).backward(g))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}, saved
    got = (_Fp32Gate.apply(x, w), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ref = F.linear(x.float(), w.float())
    ref.backward(g)
    for a, b in zip(got, (ref, x.grad, w.grad)):
        assert torch.equal(a, b)
