"""The learning-rate schedule and the FLOPs-per-token figure behind MFU."""

from __future__ import annotations

import math

import pytest
import torch

from megaframe.config import ModelConfig, load_config
from megaframe.optim.lr_schedule import lr_at
from megaframe.training.metrics import flops_per_token, matmul_params

LR, MIN_LR = 3e-3, 3e-4


# ---------------------------------------------------------------- lr_at


def test_warmup_is_linear_from_zero():
    assert lr_at(0, LR, MIN_LR, 10, 100) == 0.0
    assert lr_at(1, LR, MIN_LR, 10, 100) == pytest.approx(LR / 10)
    for s in range(1, 11):
        assert lr_at(s, LR, MIN_LR, 10, 100) == pytest.approx(LR * s / 10)
    assert lr_at(10, LR, MIN_LR, 10, 100) == pytest.approx(LR)  # peak exactly at the end of warmup


def test_cosine_decay_ends_at_min_lr_and_is_monotone():
    lrs = [lr_at(s, LR, MIN_LR, 10, 100) for s in range(10, 101)]
    assert lrs[0] == pytest.approx(LR)
    assert lrs[-1] == pytest.approx(MIN_LR)
    assert all(b < a for a, b in zip(lrs, lrs[1:]))  # strictly decreasing after the peak
    assert all(MIN_LR <= x <= LR for x in lrs)
    assert lr_at(55, LR, MIN_LR, 10, 100) == pytest.approx((LR + MIN_LR) / 2)  # cosine midpoint
    # the cosine shape: a quarter of the way down
    assert lr_at(35, LR, MIN_LR, 10, 110) == pytest.approx(
        MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi / 4))
    )


def test_after_max_steps_stays_at_min_lr():
    for s in (100, 101, 150, 10_000):
        assert lr_at(s, LR, MIN_LR, 10, 100) == pytest.approx(MIN_LR)


def test_no_warmup():
    assert lr_at(0, LR, MIN_LR, 0, 50) == pytest.approx(LR)
    assert MIN_LR < lr_at(1, LR, MIN_LR, 0, 50) < LR
    assert lr_at(1, LR, MIN_LR, 0, 50) == pytest.approx(
        MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi / 50))
    )
    assert lr_at(50, LR, MIN_LR, 0, 50) == pytest.approx(MIN_LR)
    lrs = [lr_at(s, LR, MIN_LR, 0, 50) for s in range(0, 51)]
    assert all(b < a for a, b in zip(lrs, lrs[1:]))


def test_warmup_as_long_as_the_run():
    assert lr_at(5, LR, MIN_LR, 10, 10) == pytest.approx(LR / 2)
    assert lr_at(10, LR, MIN_LR, 10, 10) == pytest.approx(LR)
    assert lr_at(11, LR, MIN_LR, 10, 10) == pytest.approx(MIN_LR)


def test_min_lr_equal_to_lr_is_constant_after_warmup():
    assert {round(lr_at(s, LR, LR, 5, 40), 12) for s in range(5, 60)} == {LR}


# ---------------------------------------------------------------- FLOPs per token


def dense(**kw) -> ModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        seq_length=32,
        vocab_size=100,
        norm="layernorm",
        activation="gelu",
        position_embedding="learned",
        tie_embeddings=True,
        bias=True,
    )
    return ModelConfig(**{**base, **kw})


def test_gpt2_small_flops_by_hand():
    m = load_config(["model=gpt2_small", "data=synthetic"], world_size=1).model
    # N = L * (qkv 3d^2 + out d^2 + mlp 8d^2) + head V*d = 12 * 12 * 768^2 + 50304 * 768
    assert matmul_params(m) == 84_934_656 + 38_633_472 == 123_568_128
    # 6N + 12 * L * d * s = 741,408,768 + 12 * 12 * 768 * 1024 (= 113,246,208)
    assert flops_per_token(m) == 854_654_976
    assert flops_per_token(m, causal=True) == 741_408_768 + 56_623_104


def test_llama3_8b_flops_by_hand():
    m = load_config(["model=llama3_8b", "data=synthetic"], world_size=1).model
    # per layer: qkv 4096 x (32 + 2*8) x 128, out 4096^2,
    # SwiGLU 3 x 4096 x 14336; plus untied head 128256 x 4096
    n = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096
    assert matmul_params(m) == n == 7_504_658_432  # Llama-3-8B's 8.03B minus the 0.525B input embedding
    assert flops_per_token(m) == 6 * n + 12 * 32 * 4096 * 8192


@pytest.mark.parametrize(
    "kw", [{}, {"num_layers": 5}, {"seq_length": 128}, {"hidden_size": 96, "num_attention_heads": 6}]
)
def test_flops_is_6n_plus_attention_term(kw):
    m = dense(**kw)
    d, L, s, f, v = m.hidden_size, m.num_layers, m.seq_length, m.ffn_hidden_size, m.vocab_size
    n = L * (4 * d * d + 2 * d * f) + v * d
    assert matmul_params(m) == n
    assert flops_per_token(m) == 6 * n + 12 * L * d * s
    full, causal = flops_per_token(m), flops_per_token(m, causal=True)
    assert full - causal == 6 * L * d * s  # causal halves exactly the attention term
    assert causal - 6 * n == (full - 6 * n) / 2


def test_gqa_and_swiglu_matmul_params():
    m = dense(num_query_groups=2, activation="swiglu", tie_embeddings=False)
    d, e, f, v = 64, 16, 256, 100
    assert matmul_params(m) == 2 * (d * (4 + 2 * 2) * e + 4 * e * d + 3 * d * f) + v * d


def test_flops_without_the_head_scale_linearly_with_layers():
    a, b = dense(num_layers=2), dense(num_layers=4)
    head = 6 * 100 * 64
    assert flops_per_token(b) - head == 2 * (flops_per_token(a) - head)


@pytest.mark.parametrize("name", ["gpt_tiny", "gpt2_tiny", "gpt2_small", "llama_1b"])
def test_matmul_params_equal_the_models_matmul_weights(name):
    from megaframe.model.gpt import GPT
    from megaframe.parallel.mesh import single_process_mesh

    m = load_config([f"model={name}", "data=synthetic"], world_size=1).model
    model = GPT(m, single_process_mesh(), device=torch.device("meta"))
    # every 2-D weight a token multiplies by: not the position
    # table, and the input embedding only as a tied head
    n = sum(
        p.numel()
        for k, p in model.named_parameters()
        if p.dim() == 2 and k != "pos_embed" and (k != "embed.weight" or m.tie_embeddings)
    )
    assert matmul_params(m) == n


# ---------------------------------------------------------------- published FLOPs figures


def test_megatron_gpt3_175b_model_flops():
    """Korthikanti et al. 2022 (and Narayanan et al. 2021 without recompute): model FLOPs per iteration
    72 * B * s * L * h^2 * (1 + s / (6h) + V / (12 L h)) for GPT-3 175B (L=96, h=12288, s=2048, V=51200)."""
    L, h, s, V = 96, 12288, 2048, 51200
    m = ModelConfig(
        num_layers=L,
        hidden_size=h,
        num_attention_heads=96,
        ffn_hidden_size=4 * h,
        seq_length=s,
        vocab_size=V,
        norm="layernorm",
        activation="gelu",
        position_embedding="learned",
        tie_embeddings=True,
        bias=True,
    )
    assert matmul_params(m) / 1e9 == pytest.approx(
        174.6, abs=0.05
    )  # the paper's "175B" (biases, norms aside)
    per_token = 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops_per_token(m) == pytest.approx(per_token, rel=1e-12)
    # the 96 * B*s*L*h^2 * (1 + s/6h + V/16Lh) form counts
    # a 4th (recompute) forward of the layers, not the head
    hardware = 96 * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert hardware == pytest.approx(4 / 3 * (flops_per_token(m) - 6 * V * h) + 6 * V * h, rel=1e-12)


@pytest.mark.parametrize("L,d,H,billions", [(32, 4096, 16, 8.63), (64, 8192, 32, 62.50)])
def test_palm_params_and_flops(L, d, H, billions):
    """PaLM 8B and 62B (Chowdhery et al. 2022, table 1: SwiGLU, multi-query, head dim Q=256, shared
    256k embedding): their parameter counts, and appendix B's model FLOPs per token 6N + 12 * L * H * Q *
    T."""
    Q, T = 256, 2048
    m = ModelConfig(
        num_layers=L,
        hidden_size=d,
        num_attention_heads=H,
        num_query_groups=1,
        ffn_hidden_size=4 * d,
        seq_length=T,
        vocab_size=256_000,
        tie_embeddings=True,
    )
    assert m.head_dim == Q
    n = matmul_params(m)
    assert n / 1e9 == pytest.approx(billions, abs=0.005)
    assert flops_per_token(m) == 6 * n + 12 * L * H * Q * T


def test_moe_counts_only_active_experts_and_router():
    dense_m = dense(activation="swiglu", tie_embeddings=False)
    moe = dense(activation="swiglu", tie_embeddings=False, num_experts=8, moe_top_k=2)
    d, f, L = 64, 256, 2
    assert matmul_params(moe) - matmul_params(dense_m) == L * (3 * d * f + d * 8)  # a 2nd expert + router
    moe.moe_ffn_hidden_size = 128  # the MoE branch's key (read with getattr until it lands)
    assert matmul_params(moe) - matmul_params(dense_m) == L * (2 * 3 * d * 128 - 3 * d * f + d * 8)
    # Mixtral 8x7B: ~12.9B active params per token, of which ~12.5B in matmuls besides the input embedding
    mix = ModelConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        num_experts=8,
        moe_top_k=2,
    )
    active = matmul_params(mix) + 32000 * 4096 + 32 * 2 * 4096 + 4096  # + input embedding and norms
    assert active / 1e9 == pytest.approx(12.9, abs=0.05)


def test_throughput_figures():
    from megaframe.training.metrics import throughput_figures

    out = throughput_figures(1000.0, 6e9, 2, 989e12)
    assert out["tflops_per_device"] == pytest.approx(3.0)
    assert out["mfu"] == pytest.approx(3e12 / 989e12)
    assert throughput_figures(1000.0, 6e9, 2, 0.0)["mfu"] is None  # unknown peak: not reported
    assert throughput_figures(1000.0, 6e9, 2, 1e12)["mfu"] is None  # faster than the peak: the peak is wrong


# ---------------------------------------------------------------- optim.lr_schedule


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    from megaframe.config import LRSchedule

    lrs = {s: lr_at(s, LR, MIN_LR, 10, 100, LRSchedule.wsd, 0.2) for s in range(0, 131)}
    assert lrs[10] == lrs[50] == lrs[80] == LR  # stable until the last 20 steps of the 100-step horizon
    assert lrs[90] == pytest.approx((LR + MIN_LR) / 2)  # halfway through the linear decay
    assert all(lrs[s] == pytest.approx(MIN_LR) for s in range(100, 131))  # min_lr at and past the horizon
    assert all(lrs[s + 1] < lrs[s] for s in range(80, 100))


def test_linear_and_constant_schedules():
    from megaframe.config import LRSchedule

    assert lr_at(55, LR, MIN_LR, 10, 100, LRSchedule.linear) == pytest.approx((LR + MIN_LR) / 2)
    assert lr_at(100, LR, MIN_LR, 10, 100, "linear") == pytest.approx(MIN_LR)
    assert {lr_at(s, LR, MIN_LR, 10, 100, LRSchedule.constant) for s in range(10, 300)} == {LR}


def test_lr_schedule_is_an_enum_in_the_config():
    from megaframe.config import ConfigError, LRSchedule

    cfg = load_config(
        ["data=synthetic", "optim.lr_schedule=wsd", "optim.wsd_decay_fraction=0.3"], world_size=1
    )
    assert cfg.optim.lr_schedule is LRSchedule.wsd and cfg.optim.lr_decay_steps is None
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_config(["data=synthetic", "optim.lr_schedule=cosin"], world_size=1)


# ---------------------------------------------------------------- the CPU peak behind MFU


def test_cpu_peak_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    from megaframe.training import metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda: calls.append(1) or 1.5e11)
    assert metrics.cpu_peak_flops() == 1.5e11 and metrics.cpu_peak_flops() == 1.5e11 and len(calls) == 1
    assert (tmp_path / "megaframe" / "cpu_peak.json").is_file()
    metrics.forget_cpu_peak()  # a step beat the peak: measured again at the next start
    assert metrics.cpu_peak_flops() == 1.5e11 and len(calls) == 2
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")
    assert metrics.cpu_peak_flops() == 0.0  # cannot cache: not reported rather than re-measured per run


def test_cpu_peak_measurement_is_a_plausible_matmul_rate():
    peak = __import__("megaframe.training.metrics", fromlist=["x"]).measure_cpu_peak(reps=5)
    assert 1e9 < peak < 1e13


def test_the_summary_after_a_resume_adds_the_whole_runs_steps_and_tokens():
    """A resumed start's summary said only its own part ("200 steps (101..300)"): it adds the whole run's
    steps and tokens, from the consumed count (exact across a batch-size change at the resume)."""
    import time
    from types import SimpleNamespace

    from megaframe.checkpoint.resume_checks import Accounting
    from megaframe.training.meter import Meter

    # resumed at step 100 with 1,600 samples of 128 tokens consumed, then batch 32 for 200 steps
    meter = SimpleNamespace(
        t_start=time.perf_counter(),
        run_steps=200,
        tokens_step=32 * 128,
        last={"loss": 5.2},
        eval_s=0.0,
        acct=Accounting(100, 1600, 32, 128),
    )
    line = Meter.summary(meter, 100, 300, "ck/step_00000300")
    assert "200 steps (101..300)" in line and "whole run: steps 1..300, 1,024,000 tokens" in line
    fresh = Meter.summary(SimpleNamespace(**{**vars(meter), "acct": Accounting(0, 0, 32, 128)}), 0, 200, None)
    assert "whole run" not in fresh
