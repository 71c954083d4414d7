"""train.precision=fp8 with a linear whose local weight does not fit float8 GEMMs (a dim not a multiple of
16): that linear keeps its bf16 GEMM, named in one warning line, and the run trains (it was refused
before)."""

import torch

from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model


def test_linears_that_do_not_fit_float8_stay_bf16_with_one_warning(capsys):
    cfg = tiny_config(["train.precision=fp8", "model.ffn_hidden_size=100"], 1)  # up [200, 64], down [64, 100]
    model = build_model(cfg, single_process_mesh())
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kept in bf16" in err[0], err
    for name in ("mlp.up_proj [200, 64]", "mlp.down_proj [64, 100]"):
        assert name in err[0], (name, err[0])
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and name.startswith("layers."):
            fits = not (mod.weight.shape[0] % 16 or mod.weight.shape[1] % 16)
            assert (mod.gemm is not None) == fits, name
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    loss = model.forward_chunk(0, None, ids, ids).float().sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters() if p.grad is not None)
