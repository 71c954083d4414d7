"""The one-GPU step figures: megaframe against compiled transformers and compiled torchtitan at the
llama_1b shape with 8 micro-batches per optimizer step, bf16 and fp8, plus the top kernels by time
(the fourth GPU review's device script, shared/notes/gpu-check-4.py; its --dry run is in the suite).

Run from the megaframe project root on ONE H100 (or H200), after the project's install:

    timeout 420 python scripts/gpu_figures.py 2>&1 | tee gpu_figures.log   # stops itself at --budget (390 s)
    python scripts/gpu_figures.py --dry                                   # CPU harness check, tiny shapes

No network is needed. torchtitan lines need `import torchtitan` on the GPU machine: carry the wheels and
`pip install --no-deps` them first (checked with torch 2.13 + torchtitan 0.3.0 + spmd_types + tyro +
docstring_parser); without them the script prints SKIP lines for torchtitan and goes on.

Shape A (every figure unless named): conf/model/llama_1b.yaml's dims (D 2048, 32 heads / 8 kv heads, E 64,
F 8192
SwiGLU, V 128256 untied, RoPE 5e5) with 8 of its 16 layers, micro-batch 2 x 2048 tokens, 8 micro-batches per
optimizer step (32,768 tokens per step). Shape C (--with-8b, or --only C): llama3_8b dims (D 4096, 32/8 heads,
E 128, F 14336) with 4 layers, micro-batch 1 x 8192, 8 micro-batches.

One line per figure:
  RESULT <figure>: tok/s | MFU | ms per optimizer step | ms per micro-batch | optimizer-step ms (timed alone)
                   | peak GiB | build+warm-up s | graph breaks / graphs / recompiles | loss
  KERNELS <figure>: the top-10 device kernels of one profiled optimizer step (name, calls, ms, share), and one
                   CATEGORIES line (GEMM, attention, triton, eager elementwise, optimizer, copies)
Figures, most important first (a figure the --budget cannot fit prints SKIP):
  A mf-bf16        megaframe train_step: bf16 params, ZeRO-1 fp32 master+grads, fused AdamW, compiled blocks,
                   fused head + CE (its softmax chain compiled), weight grads into main_grad (layers/wgrad.py)
  A hf-bf16        transformers LlamaForCausalLM (sdpa): bf16 autocast over fp32 params, every decoder layer
                   compiled + compiled loss, fused AdamW, clip_grad_norm_(foreach) - bench_gpu.py's recipe
  A tt-bf16        torchtitan 0.3 Llama3 at the same dims: SDPA inner attention, blocks compile(fullgraph),
                   compiled loss, same optimizer recipe (torchtitan's single-GPU path is autocast, no FSDP)
  A mf-fp8         train.precision=fp8, tensorwise, train.fp8_head=true (head GEMMs float8: opt-in)
  A mf-fp8-nohead  the same with train.fp8_head=false (the default; the head's float8 casts run eagerly:
                   this isolates them)
  A tt-fp8 / A hf-fp8  torchao convert_to_float8_training(tensorwise) on the peers' linears, the output head
                   excluded (torchtitan's filter_fqns=["output"]), then compiled as above
  C mf-bf16 / C hf-bf16  (--with-8b) the 8B-layer shape
--extras: the fused head + CE alone (bf16 and fp8) against its three GEMMs, and SDPA's cuDNN vs flash kernels
at A's attention shape (fwd+bwd), with the backend SDPA picks for megaframe's q/k/v layout.

Timing: each figure builds, runs --warmup optimizer steps (compiles happen there), then --steps timed steps
with no sync inside (one at the end): tokens/s is the wall rate of whole optimizer steps. The optimizer step
alone (norm, clip, AdamW, master->bf16; the peers' clip + AdamW) is timed afterwards between syncs, so the
split does not perturb the rate. MFU = tokens/s x megaframe's flops_per_token (6 N_matmul + 12 L S H E: head
counted, embedding not, no causal discount; torchtitan's and MosaicML's count) / the dense bf16 peak
(989 TF/s H100 SXM), for every side, fp8 included (torchtitan reports fp8 against the bf16 peak too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
ARGS = argparse.Namespace(dry=True, verbose=False)
DEV = torch.device("cpu")
BACKEND = "inductor"
RESULTS: dict[str, dict] = {}
ORDER: list[str] = []
LR, BETAS, EPS_ADAM, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0

SHAPES = {  # name: dims
    "A": dict(
        layers=8, hidden=2048, heads=32, kv=8, ffn=8192, vocab=128256, seq=2048, batch=2, theta=500000.0
    ),
    "C": dict(
        layers=4, hidden=4096, heads=32, kv=8, ffn=14336, vocab=128256, seq=8192, batch=1, theta=500000.0
    ),
}
DRY = {
    "A": dict(layers=2, hidden=64, heads=4, kv=2, ffn=128, vocab=512, seq=64, batch=2, theta=500000.0),
    "C": dict(layers=2, hidden=128, heads=4, kv=2, ffn=256, vocab=512, seq=128, batch=1, theta=500000.0),
}


def say(tag: str, name: str, msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {tag:<7} {name}: {msg}", flush=True)


def dims(shape: str) -> dict:
    return dict((DRY if ARGS.dry else SHAPES)[shape])


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def cleanup() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        torch._dynamo.reset()  # fresh guards per figure; inductor's on-disk FX cache stays warm
        from torch._dynamo.utils import counters

        counters.clear()  # graph breaks / graphs / recompiles counted per figure
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0][:240] if s else ''}"


def budget_left() -> float:
    return ARGS.budget - (time.perf_counter() - T0)


def wanted(key: str) -> bool:
    return not ARGS.only or any(s.strip() and s.strip() in key for s in ARGS.only.split(","))


def make_steps(d: dict, n_steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """n_steps optimizer steps of --micro-batches (ids_BS, labels_BS) pairs, made once, on the device."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_steps):
        mbs = []
        for _ in range(ARGS.micro_batches):
            t = torch.randint(0, d["vocab"], (d["batch"], d["seq"] + 1), generator=g).to(DEV)
            mbs.append((t[:, :-1], t[:, 1:]))
        out.append(mbs)
    return out


def mf_config(d: dict, precision: str, extra=()):
    from megaframe.config import load_config

    over = [
        "model=llama_1b",
        "data=synthetic",
        f"model.num_layers={d['layers']}",
        f"model.hidden_size={d['hidden']}",
        f"model.num_attention_heads={d['heads']}",
        f"model.num_query_groups={d['kv']}",
        f"model.ffn_hidden_size={d['ffn']}",
        f"model.vocab_size={d['vocab']}",
        f"model.seq_length={d['seq']}",
        f"model.rope_theta={d['theta']}",
        f"train.micro_batch_size={d['batch']}",
        f"train.global_batch_size={d['batch'] * ARGS.micro_batches}",
        f"optim.lr={LR}",
        f"optim.beta1={BETAS[0]}",
        f"optim.beta2={BETAS[1]}",
        f"optim.eps={EPS_ADAM}",
        f"optim.weight_decay={WD}",
        f"optim.clip_grad={CLIP}",
        "optim.warmup_steps=0",
        f"optim.min_lr={LR}",
        "train.max_steps=1000000",
        f"train.device={DEV.type}",
        "train.compile=true",
        "train.recompute=none",
        f"train.precision={precision}",
        "optim.zero=1",
        "logging.wandb.mode=disabled",
        *extra,
    ]
    return load_config(over, world_size=1, check_data=False)


def flops_per_token(d: dict) -> float:
    """megaframe's training/metrics.py flops_per_token for these dims (checked against it in env())."""
    D, H, K, Fh, V, S, L = d["hidden"], d["heads"], d["kv"], d["ffn"], d["vocab"], d["seq"], d["layers"]
    E = D // H
    per_layer = D * (H + 2 * K) * E + H * E * D + 3 * D * Fh
    return 6 * (L * per_layer + V * D) + 12 * L * S * H * E


def peak_flops() -> float:
    if DEV.type != "cuda":
        return 0.0
    try:
        from megaframe.training.metrics import gpu_peak

        return gpu_peak(torch.cuda.get_device_name())
    except Exception:  # noqa: BLE001
        name = torch.cuda.get_device_name()
        table = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H200": 989e12, "H100": 989e12}
        return next((v for k, v in table.items() if k in name), 0.0)


# ----------------------------------------------------------------------------------------------- the sides
def mf_builder(shape: str, precision: str, fp8_head: bool = True):
    """megaframe's own train_step on a one-process mesh (bench_gpu.py's megaframe side)."""

    def build():
        from megaframe.config.derived import derive
        from megaframe.model.parallelize import build_for
        from megaframe.parallel.mesh import single_process_mesh
        from megaframe.training.step import optimizer_step

        d = dims(shape)
        extra = (
            ["train.fp8_recipe=tensorwise", f"train.fp8_head={str(fp8_head).lower()}"]
            if precision == "fp8"
            else []
        )
        cfg = mf_config(d, precision, extra)
        mesh = single_process_mesh(DEV)
        model, opt = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
        n = [0]

        def step(mbs):
            n[0] += 1
            return optimizer_step(model, opt, mbs, mesh, cfg.optim, derive(cfg, 1), n[0]).loss_sum

        def update_only():
            opt.step(LR)  # grads kept from the last step: norm, AdamW (clip as grad_scale), master -> bf16

        note = f"{type(opt).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params"
        return step, update_only, note, (model, opt)

    return build


def _ce_sum(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="sum")


def _peer_step(model, forward, tokens_per_step: int):
    """bf16 autocast over fp32 params, grads accumulated over the micro-batches, clip, fused AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS_ADAM,
        fused=True,
    )
    autocast = torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=DEV.type == "cuda")

    def update_only():
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()

    def step(mbs):
        total = None
        for ids_BS, labels_BS in mbs:
            with autocast:
                loss = forward(ids_BS, labels_BS)
            (loss / tokens_per_step).backward()
            total = loss.detach() if total is None else total + loss.detach()
        update_only()
        opt.zero_grad(set_to_none=True)
        return total

    return step, update_only, opt


def _float8(model, skip: str) -> int:
    """torchao's float8 training (tensorwise) on every nn.Linear with dims % 16 == 0 except the head."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(mod, fqn):
        if not isinstance(mod, torch.nn.Linear):
            return False
        return fqn.split(".")[-1] != skip and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name("tensorwise"), module_filter_fn=keep
    )
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())


def hf_builder(shape: str, fp8: bool = False):
    def build():
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM

        d = dims(shape)
        hc = LlamaConfig(
            vocab_size=d["vocab"],
            hidden_size=d["hidden"],
            intermediate_size=d["ffn"],
            num_hidden_layers=d["layers"],
            num_attention_heads=d["heads"],
            num_key_value_heads=d["kv"],
            max_position_embeddings=d["seq"],
            rms_norm_eps=1e-5,
            rope_theta=d["theta"],
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=False,
        )
        hc._attn_implementation = "sdpa"
        with torch.device(DEV):
            model = LlamaForCausalLM(hc).train()
        n8 = _float8(model, "lm_head") if fp8 else 0
        for layer in model.model.layers:
            layer.compile(backend=BACKEND, dynamic=False)
        loss = torch.compile(_ce_sum, backend=BACKEND, dynamic=False)
        step, update_only, opt = _peer_step(
            model,
            lambda ids, labels: loss(model(input_ids=ids).logits, labels),
            d["batch"] * d["seq"] * ARGS.micro_batches,
        )
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        note = f"transformers {transformers.__version__}, {n_params:.1f}M fp32"
        return step, update_only, note + (f", {n8} Float8Linear" if fp8 else ""), (model, opt)

    return build


def tt_builder(shape: str, fp8: bool = False):
    def build():
        from functools import partial

        import torchtitan
        from torch import nn
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3 import Llama3Model
        from torchtitan.models.llama3 import _build_llama3_layers as build_layers

        d = dims(shape)
        dim, heads, vocab = d["hidden"], d["heads"], d["vocab"]
        lin = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
        blocks = build_layers(
            n_layers=d["layers"],
            dim=dim,
            n_heads=heads,
            n_kv_heads=d["kv"],
            hidden_dim=d["ffn"],
            rope=ComplexRoPE.Config(
                dim=dim // heads, max_seq_len=d["seq"], theta=d["theta"], scaling="llama"
            ),
            attn_backend="flex",
            fuse_qkv=True,
        )
        for b in blocks:  # causal SDPA (torchtitan's own SDPA module: cuDNN first), as the other sides run
            b.attention.inner_attention = ScaledDotProductAttention.Config()
        cfg = Llama3Model.Config(
            dim=dim,
            vocab_size=vocab,
            enable_weight_tying=False,
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab,
                embedding_dim=dim,
                param_init={"weight": partial(nn.init.normal_, std=1.0)},
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": nn.init.ones_}),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=lin),
            layers=blocks,
        )
        with torch.device(DEV):
            model = cfg.build()
        if hasattr(model, "init_states"):
            model.init_states(buffer_device=DEV)
        model.train()
        head = next((n for n, m in model.named_children() if isinstance(m, nn.Linear)), "output")
        n8 = _float8(model, head.split(".")[-1]) if fp8 else 0
        for block in model.layers.values():
            block.compile(backend=BACKEND, fullgraph=True)
        loss = torch.compile(_ce_sum, backend=BACKEND, dynamic=False)
        step, update_only, opt = _peer_step(
            model, lambda ids, labels: loss(model(ids), labels), d["batch"] * d["seq"] * ARGS.micro_batches
        )
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        note = f"torchtitan {getattr(torchtitan, '__version__', '?')}, {n_params:.1f}M fp32"
        return (
            step,
            update_only,
            note + (f", {n8} Float8Linear (head '{head}' kept)" if fp8 else ""),
            (model, opt),
        )

    return build


# ----------------------------------------------------------------------------------------------- profile
# (category, substrings of kernel names), first match wins; inductor's names embed fused aten op names
CATS = [
    ("triton (compiled)", ("triton",)),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "_attn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "scaled_mm", "sm90_", "sm80_", "wgmma")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "norm_kernel", "lpnorm")),
    ("copy/memset", ("memcpy", "memset", "copy_kernel", "fill", "catarray")),
    (
        "eager elementwise/reduce",
        (
            "elementwise",
            "vectorized",
            "reduce",
            "index",
            "scatter",
            "gather",
            "embedding",
            "softmax",
            "unrolled",
            "where",
            "clamp",
            "abs",
            "max",
        ),
    ),
]


def _category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATS if any(k in low for k in keys)), "other")


def profile_step(key: str, step, mbs) -> None:
    """One optimizer step under torch.profiler: the top-10 device kernels by time, and time by category."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    sync()
    with profile(activities=acts) as prof:
        step(mbs)
        sync()
    dev = DeviceType.CUDA if DEV.type == "cuda" else DeviceType.CPU
    rows = []
    for e in prof.key_averages():
        if DEV.type == "cuda":
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if e.device_type != dev or t <= 0:
                continue
        else:
            t = e.self_cpu_time_total
            if t <= 0 or not e.key.startswith("aten::"):
                continue
        rows.append((t, e.count, e.key))
    total = sum(r[0] for r in rows) or 1.0
    rows.sort(reverse=True)
    say(
        "KERNELS",
        key,
        f"one optimizer step ({ARGS.micro_batches} micro-batches): {total / 1e3:.1f} ms of "
        f"{'device kernels' if DEV.type == 'cuda' else 'CPU aten ops (--dry)'}, {len(rows)} kinds, top 10:",
    )
    for t, n, name in rows[:10]:
        print(f"    {t / 1e3:8.2f} ms {100 * t / total:5.1f}%  x{n:<5d} {name[:110]}", flush=True)
    cats: dict[str, float] = {}
    for t, _, name in rows:
        c = _category(name)
        cats[c] = cats.get(c, 0.0) + t
    say(
        "CATS",
        key,
        " | ".join(
            f"{c} {v / 1e3:.1f} ms ({100 * v / total:.0f}%)"
            for c, v in sorted(cats.items(), key=lambda kv: -kv[1])
        ),
    )
    RESULTS.setdefault(key, {})["kernels"] = rows[:10]


# ----------------------------------------------------------------------------------------------- measuring
def _dynamo_counts() -> str:
    try:
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"].get("unique_graphs", 0)
        recompiles = sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0
        return f"graph breaks {breaks}, graphs {graphs}, recompiles {recompiles}"
    except Exception:  # noqa: BLE001
        return "dynamo counters n/a"


def measure(key: str, shape: str, est_s: float, build, prof: bool = False) -> None:
    if not wanted(key):
        return
    if budget_left() < est_s:
        say("SKIP", key, f"budget: {budget_left():.0f}s left, ~{est_s:.0f}s needed (--budget, --only)")
        return
    ORDER.append(key)
    cleanup()
    objs = step = update_only = steps = None
    try:
        t0 = time.perf_counter()
        step, update_only, note, objs = build()
        d = dims(shape)
        steps = make_steps(d, 2)
        for i in range(ARGS.warmup):
            loss = step(steps[i % 2])
        sync()
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        for i in range(ARGS.steps):
            loss = step(steps[i % 2])
        lv = float(loss) / (d["batch"] * d["seq"] * ARGS.micro_batches)  # waits for the device
        dt = (time.perf_counter() - t1) / ARGS.steps
        mem = torch.cuda.max_memory_allocated() / 2**30 if DEV.type == "cuda" else float("nan")
        sync()
        t2 = time.perf_counter()
        reps = 2 if ARGS.dry else 5
        for _ in range(reps):
            update_only()
        sync()
        opt_ms = 1e3 * (time.perf_counter() - t2) / reps
        tokens = d["batch"] * d["seq"] * ARGS.micro_batches
        tps = tokens / dt
        fpt = flops_per_token(d)
        peak = peak_flops()
        r = {
            "shape": shape,
            "tps": tps,
            "mfu": tps * fpt / peak if peak else None,
            "step_ms": 1e3 * dt,
            "mb_ms": (1e3 * dt - opt_ms) / ARGS.micro_batches,
            "opt_ms": opt_ms,
            "mem": mem,
            "first": first,
            "loss": lv,
            "note": note,
        }
        RESULTS[key] = r
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        ok = math.isfinite(lv)
        say(
            "RESULT" if ok else "FAIL",
            key,
            f"{tps:,.0f} tok/s | MFU {mfu} | {r['step_ms']:.1f} ms/step | {r['mb_ms']:.2f} ms/micro-batch | "
            f"optimizer step alone {opt_ms:.1f} ms | peak {mem:.1f} GiB | "
            f"build+{ARGS.warmup} warm-up {first:.0f}s | "
            f"{_dynamo_counts()} | loss {lv:.3f}{'' if ok else ' NOT FINITE'} | {note}",
        )
        if prof and not ARGS.no_profile and budget_left() > 8:
            profile_step(key, step, steps[0])
    except Exception as e:  # noqa: BLE001 - one figure failing must not hide the others
        RESULTS.pop(key, None)
        say("FAIL", key, first_line(e))
        if ARGS.verbose:
            traceback.print_exc()
    finally:
        objs = step = update_only = steps = None  # noqa: F841 - drop the model before the next is built
        cleanup()


def extra_fused_ce() -> None:
    """The fused head + CE (layers/fused_ce.py) fwd+bwd alone at A's tokens, bf16 and fp8 (HeadGemms), against
    its three bf16 GEMMs: what the chunk loop, the softmax chain, the fp32 dW and the fp8 casts cost."""
    key = "A fused-head-CE-alone"
    if not wanted(key) or budget_left() < 25:
        say("SKIP", key, "budget or --only")
        return
    try:
        cleanup()
        from megaframe.layers.fp8 import Fp8Gemm
        from megaframe.layers.fused_ce import linear_cross_entropy

        d = dims("A")
        n, dm, v = d["batch"] * d["seq"], d["hidden"], d["vocab"]
        bf = torch.bfloat16
        x = torch.randn(n, 1, dm, device=DEV, dtype=bf, requires_grad=True)
        w = (torch.randn(v, dm, device=DEV) * 0.02).to(bf).requires_grad_()
        t = torch.randint(0, v, (n, 1), device=DEV)
        x2, w2 = x.detach()[:, 0], w.detach()
        fp8 = None
        with contextlib.suppress(Exception):
            fp8 = Fp8Gemm("tensorwise", pad_inner_dim=True)

        def fused(gemm=None):
            x.grad = w.grad = None
            linear_cross_entropy(x, w, t, gemm).sum().backward()

        def gemms():
            lg = x2 @ w2.t()
            lg @ w2
            lg.t() @ x2

        res = {}
        cases = [("fused bf16", fused), ("3 GEMMs", gemms)]
        if fp8 is not None and DEV.type == "cuda":
            cases.insert(1, ("fused fp8", lambda: fused(fp8)))
        for name, fn in cases:
            for _ in range(2):
                fn()
            sync()
            reps = 2 if ARGS.dry else 8
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            res[name] = 1e3 * (time.perf_counter() - t0) / reps
        tf = 6 * n * dm * v / (res["3 GEMMs"] * 1e-3) / 1e12
        say(
            "RESULT",
            key,
            " | ".join(f"{k} {v_:.2f} ms" for k, v_ in res.items())
            + f" | GEMMs at {tf:.0f} TFLOP/s | fused bf16 / GEMMs {res['fused bf16'] / res['3 GEMMs']:.2f}x"
            + (f" | fp8 / bf16 {res['fused fp8'] / res['fused bf16']:.2f}x" if "fused fp8" in res else ""),
        )
        RESULTS[key] = res
    except Exception as e:  # noqa: BLE001
        say("FAIL", key, first_line(e))
        if ARGS.verbose:
            traceback.print_exc()
    finally:
        cleanup()


def extra_sdpa() -> None:
    """Which SDPA backend megaframe's causal_sdpa gets for its q/k/v layout (views of the SBHE qkv output),
    and cuDNN vs flash fwd+bwd time at A's attention shape."""
    key = "A sdpa-backends"
    if not wanted(key) or budget_left() < 15:
        say("SKIP", key, "budget or --only")
        return
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from megaframe.model.attention import causal_sdpa, sdpa_priority

        d = dims("A")
        s, b, h, k, e = d["seq"], d["batch"], d["heads"], d["kv"], d["hidden"] // d["heads"]
        bf = torch.bfloat16 if DEV.type == "cuda" else torch.float32
        qkv = torch.randn(s, b, (h + 2 * k) * e, device=DEV, dtype=bf)
        q, kk, vv = qkv.split([h * e, k * e, k * e], dim=-1)
        q, kk, vv = (
            t.reshape(s, b, -1, e).permute(1, 2, 0, 3).detach().requires_grad_() for t in (q, kk, vv)
        )
        names = {int(v_): n_ for n_, v_ in SDPBackend.__members__.items()}

        def choice():
            try:
                return names.get(
                    int(torch._fused_sdp_choice(q, kk, vv, None, 0.0, True, enable_gqa=True)), "?"
                )
            except Exception as e2:  # noqa: BLE001
                return f"? ({type(e2).__name__})"

        default = choice()
        # the order megaframe's causal_sdpa takes on this device (by its compute capability)
        cap = torch.cuda.get_device_capability() if DEV.type == "cuda" else (9, 0)
        with sdpa_kernel(sdpa_priority(cap), set_priority=True):
            prio = choice()
        out = [
            f"default order picks {default}",
            f"under sdpa_priority{cap} picks {prio}",
            f"global order {list(torch._C._get_sdp_priority_order())}",
        ]

        def run(fn):
            for _ in range(2):
                fn().float().sum().backward()
            sync()
            reps = 2 if ARGS.dry else 10
            t0 = time.perf_counter()
            for _ in range(reps):
                fn().float().sum().backward()
            sync()
            return 1e3 * (time.perf_counter() - t0) / reps

        if DEV.type == "cuda":
            for be, bname in ((SDPBackend.CUDNN_ATTENTION, "cuDNN"), (SDPBackend.FLASH_ATTENTION, "flash")):
                try:

                    def fn(be=be):
                        with sdpa_kernel([be]):
                            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)

                    out.append(f"{bname} fwd+bwd {run(fn):.3f} ms/layer")
                except Exception as e2:  # noqa: BLE001
                    out.append(f"{bname} unusable ({first_line(e2)[:80]})")
        out.append(f"causal_sdpa fwd+bwd {run(lambda: causal_sdpa(q, kk, vv, 0.0, True)):.3f} ms/layer")
        say("RESULT", key, " | ".join(out))
    except Exception as e:  # noqa: BLE001
        say("FAIL", key, first_line(e))
        if ARGS.verbose:
            traceback.print_exc()
    finally:
        cleanup()


def env() -> None:
    parts = [
        f"torch {torch.__version__}",
        f"cuda {torch.version.cuda}",
        f"cudnn {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else '-'}",
    ]
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        parts.append(f"megaframe {commit or '?'}")
    for mod in ("transformers", "torchao", "torchtitan", "triton"):
        try:
            m = __import__(mod)
            parts.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001
            parts.append(f"{mod} absent ({type(e).__name__})")
    if DEV.type == "cuda":
        parts += [
            torch.cuda.get_device_name(),
            f"peak {peak_flops() / 1e12:.0f} TF bf16",
            f"alloc_conf {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '-')}",
        ]
    else:
        parts.append("CPU --dry (MFU n/a, timings meaningless)")
    say("INFO", "env", " | ".join(parts))
    if (
        DEV.type == "cuda"
    ):  # optim/buffer.py's lazy storage on an unindexed device: bench_gpu.py passes "cuda"
        for dev in (torch.device("cuda"), torch.device("cuda", torch.cuda.current_device())):
            try:
                from megaframe.optim.buffer import give_storage, lazy_zeros

                t = lazy_zeros(1024, torch.float32, dev)
                view = t[10:20]
                give_storage(t)
                view.fill_(1.0)
                assert float(t.sum()) == 10.0
                say("PASS", "lazy_storage", f"lazy_zeros/give_storage on {dev}")
            except Exception as e:  # noqa: BLE001
                say(
                    "FAIL",
                    "lazy_storage",
                    f"on {dev}: {first_line(e)} (bench_gpu.py's megaframe side uses 'cuda')",
                )
    for shape in ("A", "C"):
        d = dims(shape)
        check = ""
        try:
            from megaframe.training.metrics import flops_per_token as mf_fpt

            mf = mf_fpt(mf_config(d, "bf16").model)
            check = "= megaframe's" if abs(mf - flops_per_token(d)) < 1 else f"!= megaframe's {mf / 1e9:.4f}"
        except Exception as e:  # noqa: BLE001
            check = f"(not checked: {first_line(e)[:80]})"
        say(
            "INFO",
            f"shape {shape}",
            f"{d['layers']} layers, D {d['hidden']}, heads {d['heads']}/{d['kv']}, "
            f"F {d['ffn']}, V {d['vocab']}, {ARGS.micro_batches} micro-batches of "
            f"{d['batch']} x {d['seq']} | {flops_per_token(d) / 1e9:.4f} GFLOP/token {check}",
        )


def summary() -> None:
    print("\n==== SUMMARY " + "=" * 96, flush=True)
    dev = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (--dry)"
    print(
        f"device {dev} | peak {peak_flops() / 1e12:.0f} TF | {ARGS.micro_batches} micro-batches per step, "
        f"{ARGS.steps} timed steps after {ARGS.warmup} warm-up | {time.perf_counter() - T0:.0f}s",
        flush=True,
    )
    print(
        f"{'figure':<18}{'tok/s':>10}{'MFU':>7}{'ms/step':>9}{'ms/mb':>8}{'opt ms':>8}{'GiB':>6}"
        f"{'first s':>8}",
        flush=True,
    )
    for key in ORDER:
        r = RESULTS.get(key)
        if not r or "tps" not in r:
            print(f"{key:<18}  no result (failed, skipped or cut off)", flush=True)
            continue
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        print(
            f"{key:<18}{r['tps']:>10,.0f}{mfu:>7}{r['step_ms']:>9.1f}{r['mb_ms']:>8.2f}{r['opt_ms']:>8.1f}"
            f"{r['mem']:>6.1f}{r['first']:>8.0f}",
            flush=True,
        )

    def ratio(a: str, b: str) -> None:
        ra, rb = RESULTS.get(a, {}), RESULTS.get(b, {})
        if "tps" in ra and "tps" in rb:
            print(f"ratio {a} / {b}: {ra['tps'] / rb['tps']:.3f}", flush=True)

    for a, b in (
        ("A mf-bf16", "A hf-bf16"),
        ("A mf-bf16", "A tt-bf16"),
        ("A mf-fp8", "A mf-bf16"),
        ("A mf-fp8-nohead", "A mf-bf16"),
        ("A mf-fp8", "A tt-fp8"),
        ("A mf-fp8", "A hf-fp8"),
        ("A tt-fp8", "A tt-bf16"),
        ("A hf-fp8", "A hf-bf16"),
        ("C mf-bf16", "C hf-bf16"),
    ):
        ratio(a, b)
    a = RESULTS.get("A mf-bf16", {})
    if a.get("mfu") is not None:
        print(
            f"target A megaframe bf16 MFU >= 0.45: {'PASS' if a['mfu'] >= 0.45 else 'MISS'} ({a['mfu']:.3f})"
        )


def _on_term(signum, frame) -> None:  # timeout's SIGTERM: keep what was measured
    say("INFO", "signal", f"{signal.Signals(signum).name}: printing what was measured")
    summary()
    sys.stdout.flush()
    os._exit(124)


def figures(tt: bool) -> list[tuple]:
    """(figure, shape, seconds it may need on one H100 incl. compile, builder, profile?), most important
    first; the torchtitan figures only where it imports (tt)."""
    plan = [
        ("A mf-bf16", "A", 60, mf_builder("A", "bf16"), True),
        ("A hf-bf16", "A", 60, hf_builder("A"), True),
        ("A tt-bf16", "A", 55, tt_builder("A"), False),
        ("A mf-fp8", "A", 70, mf_builder("A", "fp8"), True),
        ("A mf-fp8-nohead", "A", 35, mf_builder("A", "fp8", fp8_head=False), False),
        ("A tt-fp8", "A", 60, tt_builder("A", fp8=True), False),
        ("A hf-fp8", "A", 60, hf_builder("A", fp8=True), False),
    ]
    if not tt:
        plan = [p for p in plan if not p[0].startswith("A tt")]
    if ARGS.with_8b or "C" in ARGS.only:
        plan += [
            ("C mf-bf16", "C", 60, mf_builder("C", "bf16"), True),
            ("C hf-bf16", "C", 60, hf_builder("C"), False),
        ]
    return plan


def refuse_an_only_naming_no_figure(plan: list[tuple]) -> None:
    """A typo in --only would spend a device slot on nothing: exit 2, one line naming the figures."""
    known = [p[0] for p in plan] + ["C mf-bf16", "C hf-bf16", "A fused-head-CE-alone", "A sdpa-backends"]
    if ARGS.only and not any(wanted(k) for k in known):
        names = ", ".join(known)
        print(f"gpu_figures: error: --only {ARGS.only!r} names no figure of: {names}", file=sys.stderr)
        raise SystemExit(2)


def main() -> None:
    global ARGS, DEV, BACKEND
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dry", action="store_true", help="CPU, tiny shapes, aot_eager compile: the harness only"
    )
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps per figure (default 3)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed first steps, compiles included (default 2)"
    )
    ap.add_argument("--micro-batches", type=int, default=8, help="per optimizer step, every side")
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds; later figures print SKIP (default 390)"
    )
    ap.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; --dry aot_eager)"
    )
    ap.add_argument("--extras", action="store_true", help="+ fused head+CE alone, SDPA backends")
    ap.add_argument("--with-8b", action="store_true", help="+ shape C (llama3_8b dims, 4 layers, 1 x 8192)")
    ap.add_argument("--no-profile", action="store_true", help="no KERNELS lines")
    ap.add_argument("--only", default="", help="comma list of figure-name substrings, e.g. 'A mf-bf16,A hf'")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of failures")
    ARGS = ap.parse_args()
    ARGS.steps = ARGS.steps or (1 if ARGS.dry else 3)
    ARGS.warmup = ARGS.warmup if ARGS.warmup is not None else (1 if ARGS.dry else 2)
    if ARGS.dry and ARGS.micro_batches == 8:
        ARGS.micro_batches = 2
    ARGS.budget = ARGS.budget or (900.0 if ARGS.dry else 390.0)
    BACKEND = ARGS.backend or ("aot_eager" if ARGS.dry else "inductor")
    if not ARGS.dry and not torch.cuda.is_available():
        raise SystemExit("gpu_figures: no CUDA device (--dry runs the CPU harness)")
    if ARGS.dry:
        torch.set_num_threads(1)
    else:
        DEV = torch.device("cuda", torch.cuda.current_device())
    if importlib.util.find_spec("torchtitan") is None:
        # its import fails, so the figure list is known now: a bad --only is refused in a second, before
        # env() imports transformers, torchao and triton (seconds of CPU); else after torchtitan's import
        refuse_an_only_naming_no_figure(figures(tt=False))
    sys.path.insert(0, os.getcwd())  # the project root, when megaframe is not installed
    signal.signal(signal.SIGTERM, _on_term)
    if BACKEND != "inductor":  # --dry: megaframe's blocks compiled with the same backend as the peers'
        import megaframe.model.parallelize as par

        def compile_blocks(model):
            # as model/parallelize.py compiles them: the block's forward, its hooks eager around it
            par.arm()
            for block in model.layers.values():
                block.forward = torch.compile(block.forward, backend=BACKEND, dynamic=False)

        par.compile_blocks = compile_blocks
    env()
    tt = True
    try:
        import torchtitan  # noqa: F401
    except Exception as e:  # noqa: BLE001
        tt = False
        say(
            "SKIP",
            "torchtitan",
            f"not importable ({first_line(e)[:80]}): carry its wheels (see the docstring)",
        )
    plan = figures(tt)
    refuse_an_only_naming_no_figure(plan)
    for key, shape, est, build, prof in plan:
        measure(key, shape, est if not ARGS.dry else 1, build, prof)
    if ARGS.extras:
        extra_fused_ce()
        extra_sdpa()
    summary()


if __name__ == "__main__":
    main()
