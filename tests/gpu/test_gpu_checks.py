"""What one GPU can check (skipped without CUDA; `python scripts/gpu_check.py` runs every tests/gpu file
and prints a summary):
- bf16 + compile + recompute steps of the dense and the MoE model, counting device syncs with
  torch.cuda.set_sync_debug_mode("warn"): none for dense, the split sizes' one per MoE layer and
  micro-batch for MoE (twice with full recompute, which re-runs the dispatch);
- SDPA's flash kernel accepts the model's real attention call (bf16, causal, GQA, head dim 128);
- the fused head + cross-entropy in bf16 against fp32 (its fp32 head-grad accumulation included);
- the watchdog's ring buffer tells an enqueued device collective from a completed one (CUDA events);
- a one-process checkpoint round trip on CUDA, sync and async, resumes with the same losses.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.e2e.helpers import TINY, metrics, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MOE = ["model.family=mixtral", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=64"]
MOE_LAYERS, MICRO = 2, 4  # tiny_config: 2 layers, global batch 8 in micro-batches of 2


def _sync_counts(overrides: list[str], steps: int) -> tuple[list[int], list[float]]:
    """Device syncs per step after a warm-up step (compile, lazy optimizer state), and the losses."""
    from megaframe.optim.build import build_optimizer
    from megaframe.parallel.mesh import single_process_mesh
    from tests.distributed.cases import tiny_config
    from tests.forms import build_data, build_model, microbatches, train_step

    cfg = tiny_config(["train.device=cuda", *overrides], 1)
    mesh = single_process_mesh("cuda")
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    t, data = cfg.train, build_data(cfg)
    batches = [
        microbatches(data, s, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed, mesh.device)
        for s in range(steps + 1)
    ]
    train_step(model, opt, batches[0], mesh, cfg, 1)
    torch.cuda.synchronize()
    counts, results = [], []
    for s, b in enumerate(batches[1:]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # every implicit device sync warns
            try:
                results.append(train_step(model, opt, b, mesh, cfg, s + 2))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
    return counts, [r.loss_sum.item() for r in results]


DENSE = [
    [],
    ["train.precision=bf16", "train.recompute=selective"],
    ["train.precision=bf16", "train.compile=true", "train.recompute=full"],
]


@pytest.mark.parametrize("over", DENSE, ids=["fp32", "bf16-selective", "bf16-compile-full"])
def test_dense_steps_do_not_sync(over):
    counts, losses = _sync_counts(over, 3)
    assert counts == [0, 0, 0], counts
    assert all(x == x for x in losses)


@pytest.mark.parametrize(
    "over,per_layer",
    [
        ([], 1),
        (["train.precision=bf16", "train.recompute=selective"], 1),
        (["train.precision=bf16", "train.recompute=full"], 2),
    ],
    ids=["fp32", "bf16-selective", "bf16-full"],
)
def test_moe_steps_sync_once_per_layer_and_micro_batch(over, per_layer):
    counts, losses = _sync_counts(MOE + over, 3)
    assert all(c <= MOE_LAYERS * MICRO * per_layer for c in counts), counts
    assert all(x == x for x in losses)


def test_moe_bf16_compile_trains():
    """MoE blocks graph-break at the split sizes; compiled, they must still train (syncs not counted:
    new token counts per expert may recompile)."""
    _, losses = _sync_counts(
        MOE + ["train.precision=bf16", "train.compile=true", "train.recompute=selective"], 2
    )
    assert all(x == x for x in losses)


def test_flash_attention_runs_the_models_attention():
    """Only the flash kernel allowed: the model's SDPA call (causal, no mask, GQA, bf16, head dim 128,
    llama3_8b's per-rank heads at tp8: 4 query heads, 1 kv head) must run forward and backward on the
    layout the model passes it (q, k, v permuted from [S, B, H, E])."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megaframe.config import load_config
    from megaframe.model.attention import Attention, rope_tables
    from megaframe.parallel.mesh import single_process_mesh

    cfg = load_config(
        [
            "model=llama3_8b",
            "data=synthetic",
            "model.num_attention_heads=4",
            "model.num_query_groups=1",
            "model.hidden_size=512",
            "model.seq_length=2048",
        ],
        world_size=1,
        check_data=False,
    )
    assert cfg.model.head_dim == 128
    m = cfg.model
    attn = Attention(m, single_process_mesh("cuda").tp, sp=False, device="cuda").to(torch.bfloat16)
    for p in attn.parameters():  # sharded_param leaves them uninitialised
        torch.nn.init.normal_(p, std=0.02)
    rope = rope_tables(m.seq_length, m.head_dim, m.rope_theta, "cuda")
    x_SBD = torch.randn(
        m.seq_length, 1, m.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises "No available kernel" if flash cannot take it
        attn(x_SBD, rope).float().sum().backward()
    assert x_SBD.grad is not None and torch.isfinite(x_SBD.grad).all()


def test_fused_cross_entropy_bf16_matches_fp32():
    """Several CUDA chunks (V=32000: ~2k tokens each); the bf16 head grad is accumulated in fp32."""
    from megaframe.layers.fused_ce import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 16384, 512, 32000
    x = torch.randn(n, 1, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    t = torch.randint(0, v, (n, 1), device="cuda", generator=g)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        x_, w_ = (
            x.detach().to(dtype).clone().requires_grad_(True),
            w.detach().to(dtype).clone().requires_grad_(True),
        )
        loss = linear_cross_entropy(x_, w_, t).sum()
        loss.backward()
        out[dtype] = (loss.float(), x_.grad.float(), w_.grad.float())

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    (lb, xb, wb), (lf, xf, wf) = out[torch.bfloat16], out[torch.float32]
    assert rel(lb, lf) < 2e-3 and rel(wb, wf) < 1e-2 and rel(xb, xf) < 2e-2, (
        rel(lb, lf),
        rel(wb, wf),
        rel(xb, xf),
    )


def test_ring_buffer_tells_enqueued_from_completed_on_the_gpu():
    from megaframe.parallel.mesh import CommStats
    from megaframe.runops.watchdog import collective_state

    stats = CommStats()
    torch.cuda._sleep(2_000_000_000)  # keep the stream busy (~1 s) so the "collective" is only enqueued
    entry = stats.record("all_reduce", "tp", (0, 1), (4,), torch.bfloat16, 8)
    stats.returned(entry, on_device=True)
    assert collective_state(entry) == "ENQUEUED, NOT COMPLETED on the GPU"
    torch.cuda.synchronize()
    assert collective_state(entry) == "completed on the GPU"


@pytest.mark.parametrize("save", ["sync", "async"])
def test_checkpoint_round_trip_on_cuda(tmp_path, save):
    """Save at step 2 of 4, resume from it in a fresh run: steps 3-4 repeat the unbroken run's losses."""
    over = [
        "data=synthetic",
        *TINY,
        "train.device=cuda",
        "train.max_steps=4",
        "train.log_interval=1",
        "checkpoint.interval=2",
        f"checkpoint.async={str(save == 'async').lower()}",
    ]
    whole = train(over + [f"run.dir={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    assert (step2 / "metadata.json").is_file()
    resumed = train(over + [f"run.dir={tmp_path / 'resumed'}", f"checkpoint.resume={step2}"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want = {r["step"]: r["loss"] for r in metrics(tmp_path / "whole")}
    got = {r["step"]: r["loss"] for r in metrics(tmp_path / "resumed")}
    assert sorted(got) == [3, 4]
    for s in (3, 4):  # index_add's atomics in the embedding backward: not bitwise on CUDA
        assert abs(got[s] - want[s]) / want[s] < 1e-4, (got, want)


def test_grouped_experts_match_the_loop_on_cuda():
    """The experts' grouped GEMM (CUTLASS on sm90 in bf16, the padded bmm elsewhere) against the per-expert
    loop: outputs and grads (the weights' too: each row weighted inside its expert) within bf16 rounding,
    group sizes that are not multiples of 8 and empty ones."""
    from megaframe.config import load_config
    from megaframe.model.moe.layer import Experts
    from megaframe.parallel.mesh import single_process_mesh

    cfg = load_config(
        [
            "data=synthetic",
            "model=moe_tiny",
            "model.vocab_size=64",
            "model.num_experts=6",
            "model.hidden_size=256",
            "model.moe_ffn_hidden_size=512",
        ],
        world_size=1,
    ).model
    experts = Experts(cfg, single_process_mesh("cuda"), False, "cuda").to(torch.bfloat16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    sizes = [37, 0, 1, 250, 9, 100]
    x = torch.randn(sum(sizes), cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    # the router's fp32 combine weights, applied inside the experts as the dispatcher runs them
    w = torch.rand(sum(sizes), 1, device="cuda", requires_grad=True)
    outs = []
    for fn in (experts.forward, experts.forward_loop):
        y = fn(x, sizes, w_N1=w)
        outs.append((y, *torch.autograd.grad(y, (x, w, *experts.parameters()), g)))
    for a, b in zip(*outs):
        assert ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item() < 2e-2


def test_fp8_compiled_trains_like_bf16(tmp_path):
    """train.precision=fp8 (torchao float8 GEMMs, torch.compile)
    on the GPU: 30 tiny steps within 2 % of bf16."""
    pytest.importorskip("torchao")
    over = [
        "data=synthetic",
        *TINY,
        "train.max_steps=30",
        "train.log_interval=30",
        "train.device=cuda",
        "optim.zero=1",
        "train.compile=true",
    ]
    losses = {}
    for precision in ("bf16", "fp8"):
        res = train(over + [f"train.precision={precision}", f"run.dir={tmp_path / precision}"])
        assert res.returncode == 0, res.stderr[-2000:]
        losses[precision] = metrics(tmp_path / precision)[-1]["loss"]
    assert abs(losses["fp8"] - losses["bf16"]) / losses["bf16"] < 0.02, losses
