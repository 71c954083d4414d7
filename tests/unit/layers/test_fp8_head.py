"""train.precision=fp8 runs the output head's GEMMs float8 where its local weight dims allow: the fused head +
cross-entropy's logits, grad-input and grad-weight GEMMs (three float8 matmuls per token chunk), close to
the bf16 head; a head whose vocab is not a multiple of 16 keeps bf16 GEMMs, named in the one warning line."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchao.float8.float8_training_tensor import Float8TrainingTensor

from megaframe.layers import fused_ce
from megaframe.layers.fp8 import Fp8Gemm
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model


class Float8Matmuls(TorchDispatchMode):
    """Counts the matmuls whose operands are float8 (torchao's Float8TrainingTensor) and the other ones."""

    def __init__(self):
        super().__init__()
        self.float8 = self.other = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "_scaled_mm"):
            if any(isinstance(a, Float8TrainingTensor) for a in args):
                self.float8 += 1
            else:
                self.other += 1
        return func(*args, **(kwargs or {}))


def _head(gemm, chunk_elems, monkeypatch):
    monkeypatch.setitem(fused_ce.CHUNK_ELEMS, "cpu", chunk_elems)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(256, 32, generator=g) * 0.2).bfloat16().requires_grad_()
    t = torch.randint(0, 256, (64, 1), generator=g)
    with Float8Matmuls() as seen:
        loss = fused_ce.linear_cross_entropy(x, w, t, gemm).sum()
        loss.backward()
    return loss.detach().float(), x.grad.float(), w.grad.float(), seen


def test_fused_head_runs_three_float8_gemms_per_chunk_close_to_bf16(monkeypatch):
    # 64 tokens x 256 vocab in chunks of 16 tokens (4096 logits): 4 chunks, 3 float8 GEMMs each
    ref_loss, ref_gx, ref_gw, plain = _head(None, 4096, monkeypatch)
    assert plain.float8 == 0 and plain.other >= 4 * 3
    loss, gx, gw, seen = _head(Fp8Gemm("tensorwise", pad_inner_dim=True), 4096, monkeypatch)
    assert seen.float8 == 4 * 3 and seen.other == 0, (seen.float8, seen.other)
    assert abs(loss - ref_loss) / ref_loss < 0.01
    assert loss != ref_loss  # float8 rounding moved it: the float8 GEMMs ran
    for got, ref in ((gx, ref_gx), (gw, ref_gw)):
        assert (got - ref).norm() / ref.norm() < 0.1, (got - ref).norm() / ref.norm()
    # a chunk of a token count not a multiple of 16 (the grad-weight GEMM's inner dim) is padded, not refused
    # (64 tokens in a budget of 13: 8 equal chunks of 8)
    assert _head(Fp8Gemm("rowwise", pad_inner_dim=True), 256 * 13, monkeypatch)[3].float8 == 8 * 3


def test_head_gets_float8_where_its_dims_allow_and_is_named_where_not(capsys):
    on = ["train.precision=fp8", "train.fp8_head=true"]
    model = build_model(tiny_config(on, 1), single_process_mesh())
    assert model.head_gemm is not None and capsys.readouterr().err == ""
    # off by default (as torchtitan and Megatron): the head's eager casts cost more than its GEMMs save
    off = build_model(tiny_config(["train.precision=fp8"], 1), single_process_mesh())
    assert off.head_gemm is None
    cfg = tiny_config([*on, "model.vocab_size=250"], 1)
    model = build_model(cfg, single_process_mesh())
    err = capsys.readouterr().err.strip().splitlines()
    assert model.head_gemm is None and len(err) == 1 and "head [250, 64]" in err[0], err
    ids = torch.randint(0, 250, (2, cfg.model.seq_length))
    with Float8Matmuls() as seen:
        model.forward_chunk(0, None, ids, ids).float().sum().backward()
    assert seen.float8 > 0 and seen.other > 0  # the blocks' GEMMs float8, the head's bf16
