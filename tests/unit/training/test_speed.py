"""The fast path keeps the math: activation recompute and torch.compile give the plain path's losses and
grads, the step loop does not sync the host, and prefetched batches are the batches."""

from __future__ import annotations

import pytest
import torch

from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config, train_and_report

DROPOUT = ["model.dropout=0.1"]  # recompute must replay the same dropout masks


@pytest.fixture(scope="module")
def plain():
    torch.manual_seed(0)  # the dropout masks: both runs start from the same RNG state
    return train_and_report(single_process_mesh(), DROPOUT, 2)


@pytest.mark.parametrize("mode", ["selective", "full", "op_selective"])
def test_recompute_is_bit_equal_to_the_plain_path(plain, mode):
    torch.manual_seed(0)
    got = train_and_report(single_process_mesh(), DROPOUT + [f"train.recompute={mode}"], 2)
    assert got["losses"] == plain["losses"]
    for name, g in plain["grads"].items():
        assert torch.equal(got["grads"][name], g), name
    for name, w in plain["weights"].items():
        assert torch.equal(got["weights"][name], w), name


def test_compile_matches_the_plain_path_up_to_float_noise():
    base = train_and_report(single_process_mesh(), ["model.num_layers=1"], 2)
    got = train_and_report(single_process_mesh(), ["model.num_layers=1", "train.compile=true"], 2)
    assert got["losses"] == pytest.approx(base["losses"], rel=1e-5)
    for name, g in base["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6)


class _NoSync:
    """Makes every tensor-to-Python read (.item(), bool(), float(), .tolist()) an error: on CUDA each
    one waits for the device's queue to drain."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch):
        def refuse(name):
            def f(*a, **k):
                raise AssertionError(f"host sync: Tensor.{name} in the step")

            return f

        for n in self.NAMES:
            monkeypatch.setattr(torch.Tensor, n, refuse(n))


def test_train_step_and_skip_do_not_sync_the_host(monkeypatch):
    from megaframe.optim.build import build_optimizer
    from megaframe.training.trainer import BadSteps, TrainingError
    from tests.forms import build_data, build_model, microbatches, train_step

    for zero in (1, 0):
        cfg = tiny_config([f"optim.zero={zero}"], 1)
        mesh = single_process_mesh()
        model = build_model(cfg, mesh)
        opt = build_optimizer(model, cfg.optim, mesh)
        t = cfg.train
        batches = [
            microbatches(build_data(cfg), s, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed)
            for s in range(3)
        ]
        bad = BadSteps(1, False, defer=True)
        with monkeypatch.context() as m:
            _NoSync(m)
            train_step(model, opt, batches[0], mesh, cfg, 1)
            with torch.no_grad():  # a NaN weight: the next grad norm is NaN, the step must be skipped
                model.layers["0"].mlp.down_proj.weight[0, 0] = float("nan")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            res = train_step(model, opt, batches[1], mesh, cfg, 2)
            bad.check(2, res.grad_norm, flush=False)  # deferred: no read
        assert not torch.isfinite(res.grad_norm)
        for n, p in model.named_parameters():  # skipped on the device: nothing moved
            torch.testing.assert_close(p.detach(), before[n], equal_nan=True, rtol=0, atol=0)
        with pytest.raises(TrainingError, match="2 steps in a row"):  # the flush reads both: 2 > limit 1
            bad.check(3, torch.tensor(float("nan")), flush=True)


def test_prefetcher_hands_out_the_same_batches_in_order():
    from megaframe.data.dataset import Prefetcher
    from tests.forms import build_data, microbatches

    cfg = tiny_config([], 1)
    data, t = build_data(cfg), cfg.train
    load = lambda s: microbatches(data, s - 1, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed)  # noqa: E731
    pre = Prefetcher(load, 3, 5)
    try:
        for step in (3, 4, 5, 2):  # 2: out of order, read on the spot
            for (a, b), (c, d) in zip(pre.get(step), load(step)):
                assert torch.equal(a, c) and torch.equal(b, d)
    finally:
        pre.close()


@pytest.mark.parametrize("chunk_elems", [1 << 21, 200])  # one chunk, and many uneven ones
def test_fused_head_cross_entropy_equals_linear_then_cross_entropy(monkeypatch, chunk_elems):
    import torch.nn.functional as F

    from megaframe.layers import fused_ce

    monkeypatch.setitem(fused_ce.CHUNK_ELEMS, "cpu", chunk_elems)
    gen = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(12, 3, 16, generator=gen), torch.randn(50, 16, generator=gen)
    target, weights = torch.randint(0, 50, (12, 3), generator=gen), torch.rand(12, 3, generator=gen)
    for upstream in (lambda loss: loss.sum() / 7, lambda loss: (loss * weights).sum()):  # uniform, per-token
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fused_ce.linear_cross_entropy(x, w, target)
        ref = F.cross_entropy(F.linear(xr, wr).flatten(0, 1), target.flatten(), reduction="none").view(12, 3)
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        upstream(loss).backward()
        upstream(ref).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(
            fused_ce.linear_cross_entropy(x0, w0, target), ref.detach(), rtol=1e-6, atol=1e-6
        )


def test_gpu_check_dry_runs_every_check_on_cpu():
    """scripts/gpu_check.py --dry: the prepared GPU check's harness at tiny sizes on CPU (tests/gpu skip,
    the benches run: bench_vs_hf with its fp8 side, bench_experts, bench_moe_block), one line per check,
    exit 0."""
    import sys

    from megaframe.config import ROOT
    from tests.e2e.helpers import run

    # a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the harness; the
    # checks it starts are its own processes, as on a GPU host
    res = run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry"], 600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ratio megaframe_fp8 / megaframe (wall)" in res.stdout and "ratio loop / grouped:" in res.stdout
    assert "4 x 32 tokens: gpu " in res.stdout and "ratio measured / planned" in res.stdout
    assert "summary:" in res.stdout and "FAILED" not in res.stdout
    # the speed targets are parsed from bench_gpu's lines (judged only on a GPU)
    assert "(dry)        A megaframe / compiled transformers:" in res.stdout, res.stdout[-3000:]
