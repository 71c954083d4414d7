"""train.fused_head_loss=false (the whole logits and their fp32 log-softmax, as torchtitan's loss runs) is
what the trainer runs, with the fused path's losses and grads, and the planner's head transient for it
(memory.phases.head_transient_bytes) is the allocator peak a real forward + backward of the head and loss
reaches on the CPU, beside what the loss saves (the meta forward's head activations)."""

from __future__ import annotations

import pytest
import torch

from megaframe.config import load_config
from megaframe.parallel.mesh import single_process_mesh
from megaframe.parallel.virtual import virtual_mesh
from megaframe.planning.memory.activations import allocator_peak, head_activation_bytes
from megaframe.planning.memory.phases import head_transient_bytes
from megaframe.planning.memory.rank_state import rank_shape
from tests.forms import build_model

# a vocabulary much wider than the hidden size: the [tokens, V] tensors are the head's whole peak
TINY = [
    "model=llama3_8b",
    "data=synthetic",
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=256",
    "model.vocab_size=8192",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.device=cpu",
]


def _cfg(*extra: str):
    return load_config([*TINY, *extra], world_size=1, check_data=False)


def _loss_and_grads(cfg):
    torch.manual_seed(0)
    model = build_model(cfg, single_process_mesh())
    ids_BS = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(1)
    )
    loss = model(ids_BS[:, :-1], ids_BS[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_the_whole_logits_loss_gives_the_fused_losses_and_grads():
    fused, g_fused = _loss_and_grads(_cfg())
    whole, g_whole = _loss_and_grads(_cfg("train.fused_head_loss=false"))
    assert torch.allclose(fused, whole, rtol=1e-5)
    for name, g in g_fused.items():
        # float rounding of a different summation order: relative to the grad's norm
        assert (g - g_whole[name]).norm() <= 1e-4 * g.norm(), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_whole_logits_transient_is_the_measured_peak(precision):
    """The head and loss's allocator peak over a forward and backward is what the loss saves plus the
    planned transient (logits in the params' dtype and their fp32 copy beside the fp32 log-softmax), within
    5 %; the fused path's chunked figure would be 12 bytes a logit against the measured 8 (fp32) / 10
    (bf16)."""
    cfg = _cfg("train.fused_head_loss=false", f"train.precision={precision}")
    mesh = single_process_mesh()
    model = build_model(cfg, mesh)
    p = next(model.parameters())
    s_tokens = cfg.model.seq_length
    x_SBD = torch.randn(s_tokens, 2, cfg.model.hidden_size, dtype=p.dtype, requires_grad=True)
    ids_BS = torch.randint(0, cfg.model.vocab_size, (2, s_tokens), generator=torch.Generator().manual_seed(1))

    def step():
        model.head_output(x_SBD, ids_BS).float().sum().backward()

    step()  # the grads exist, as for every micro-batch after the first
    measured = allocator_peak(step)
    meta = build_model(cfg, virtual_mesh(1, 1, 1, device="meta"))
    shape = rank_shape(meta, cfg, virtual_mesh(1, 1, 1, device="meta"))
    assert shape.head_kind == "whole" and shape.head_logits == 2 * s_tokens * cfg.model.vocab_size
    planned = head_activation_bytes(meta, 2) + head_transient_bytes(shape)
    assert planned == pytest.approx(measured, rel=0.05), (planned, measured)
