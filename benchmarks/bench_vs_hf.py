"""Training tokens/s of megaframe against transformers' LlamaForCausalLM of the same dims, one process.

    python benchmarks/bench_vs_hf.py [--device cpu|cuda] [--preset cpu|1b] [--steps 3] [--repeats 5]
                                  [--warmup 2] [--threads 1] [--batch B] [--seq S] [--profile]
                                  [--fp8 [--fp8-recipe tensorwise|rowwise]] [--compile]

Both sides get the same model (hidden, layers, heads, GQA groups, ffn, vocab, seq, untied head,
RMSNorm eps, RoPE theta), the same token batch (B x S synthetic tokens, next-token labels), the same
optimizer (AdamW with the same lr/betas/eps/weight decay on matrices, global-norm clipping to 1.0;
fused kernels on both sides, CPU and CUDA) and the same number of timed steps after the same warm-up.
Repeats are interleaved (megaframe, peer, megaframe, peer, ...) so load drift hits both alike; the
median tokens/s of each and their ratio are printed, with megaframe's MFU.

The peer runs the way a transformers user trains: attn_implementation="sdpa", loss from
F.cross_entropy on the logits, torch.nn.utils.clip_grad_norm_ (foreach), torch.optim.AdamW(fused=True). On
CUDA megaframe trains with train.precision=bf16 (bf16 params, fp32 master weights in its ZeRO optimizer)
and the peer with bf16 autocast over fp32 params (the usual transformers bf16 recipe).
--preset 1b is the GPU goal (conf/model/llama_1b.yaml: ~1.2B params, seq 2048).
The peer here is eager and each step is one micro-batch; benchmarks/bench_gpu.py is the fair comparison
(compiled transformers and torchtitan, several micro-batches per step, per-step vs per-micro-batch time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# CPU size: big enough that matmuls dominate like on a real model, small enough for 2 shared cores
CPU_DIMS = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=704,
    vocab_size=8192,
    seq_length=256,
)
LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def megaframe_side(args, device: torch.device, precision: str | None = None):
    """(cfg, step function) for megaframe: the trainer's own train_step over one micro-batch."""
    from megaframe.config import load_config
    from megaframe.config.derived import derive
    from megaframe.model.parallelize import build_for
    from megaframe.parallel.mesh import single_process_mesh
    from megaframe.training.step import optimizer_step

    over = [
        "data=synthetic",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        f"optim.lr={LR}",
        f"optim.beta1={BETAS[0]}",
        f"optim.beta2={BETAS[1]}",
        f"optim.eps={EPS}",
        f"optim.weight_decay={WD}",
        f"optim.clip_grad={CLIP}",
        "optim.warmup_steps=0",
        f"optim.min_lr={LR}",
        "train.max_steps=1000000",
        f"train.device={device.type}",
        f"model.seq_length={args.seq}",
        f"train.compile={str(args.compile).lower()}",
        f"train.recompute={args.recompute}",
    ]
    if args.preset == "1b":
        over += ["model=llama_1b"] + ([f"model.num_layers={args.layers}"] if args.layers else [])
    else:
        over += [f"model.{k}={v}" for k, v in CPU_DIMS.items() if k != "seq_length"]
    precision = precision or ("bf16" if device.type == "cuda" else "fp32")  # presets default to bf16
    over += [f"train.precision={precision}", f"train.fp8_recipe={args.fp8_recipe}"]
    over += ["optim.zero=1"] if precision != "fp32" else []
    cfg = load_config(over, world_size=1, check_data=False)
    mesh = single_process_mesh(device)
    model, opt = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    counter = [0]

    def step(ids_BS, labels_BS):
        counter[0] += 1
        return optimizer_step(
            model, opt, [(ids_BS, labels_BS)], mesh, cfg.optim, derive(cfg, 1), counter[0]
        ).loss_sum

    return cfg, step


def hf_side(cfg, device: torch.device):
    """Step function of LlamaForCausalLM with cfg.model's dims, trained the standard way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hc = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads,
        max_position_embeddings=m.seq_length,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=m.init_std,
        use_cache=False,
    )
    hc._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hc).to(device).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=True,
    )  # the kernel megaframe uses, CPU and CUDA
    autocast = (
        torch.autocast("cuda", torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def step(ids_BS, labels_BS):
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits_BSV = model(input_ids=ids_BS).logits
        loss = F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="sum")
        (loss / labels_BS.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        return loss.detach()

    return step


def timed(step, batches, device) -> tuple[float, float]:
    """(wall, process CPU) seconds for len(batches) steps, device work included (one sync at the end).

    On a CPU shared with other jobs the wall time counts the waits for a core; the process CPU time
    counts only the work done, so its ratio is the steadier figure there (both are printed)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for ids_BS, labels_BS in batches:
        loss = step(ids_BS, labels_BS)
    loss.item()  # .item() waits for the device: the last step's work is counted
    return time.perf_counter() - t0, time.process_time() - c0


def make_batches(n: int, batch: int, seq: int, vocab: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens_BS1 = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
        out.append((tokens_BS1[:, :-1], tokens_BS1[:, 1:]))
    return out


def profile(name: str, step, batches) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with prof(activities=acts) as p:
        for ids_BS, labels_BS in batches:
            step(ids_BS, labels_BS)
    print(f"---- {name}: top ops by self time")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default=None, choices=["cpu", "1b"], help="default: cpu on CPU, 1b on CUDA")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="megaframe with train.compile=true")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of both and exit")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="also megaframe at train.precision=fp8 (torchao float8 GEMMs), "
        "timed in the same run: prints fp8 / bf16",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="--preset 1b with fewer layers (three models share a GPU)"
    )
    ap.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_vs_hf: --device cuda but CUDA is not available on this machine")
    args.preset = args.preset or ("1b" if args.device == "cuda" else "cpu")
    # 1b: both models (with fp32 Adam state) and their activations share one 80 GB GPU
    args.batch = args.batch or (2 if args.preset == "1b" else 4)
    args.seq = args.seq or (2048 if args.preset == "1b" else CPU_DIMS["seq_length"])
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg, mf_step = megaframe_side(args, device)
    hf_step = hf_side(cfg, device)
    batches = make_batches(args.warmup + args.steps, args.batch, args.seq, cfg.model.vocab_size, device)
    sides = {"megaframe": mf_step, "hf_llama": hf_step}
    if args.fp8:  # the fp8 side beside the bf16 one (bf16 on CPU too, so the ratio is fp8 GEMMs alone)
        if cfg.train.precision != "bf16":
            cfg, sides["megaframe"] = megaframe_side(args, device, "bf16")
        sides["megaframe_fp8"] = megaframe_side(args, device, "fp8")[1]
    for _name, step in sides.items():
        timed(step, batches[: args.warmup], device)
    if args.profile:
        for name, step in sides.items():
            profile(name, step, batches[args.warmup :])
        return
    report(args, cfg, sides, batches[args.warmup :], device)


def report(args, cfg, sides, batches, device) -> None:
    from megaframe.training.metrics import flops_per_token, peak_flops

    tokens = args.batch * args.seq * len(batches)
    tps = {name: [] for name in sides}
    cpu = {name: [] for name in sides}
    for r in range(args.repeats):  # interleaved: both see the same drift of the machine's load
        for name, step in sides.items() if r % 2 == 0 else reversed(list(sides.items())):
            wall_s, cpu_s = timed(step, batches, device)
            tps[name].append(tokens / wall_s)
            cpu[name].append(tokens / cpu_s)
    m = cfg.model
    fpt, peak = flops_per_token(m), peak_flops(device)
    print(
        f"bench_vs_hf | {device.type}, {torch.get_num_threads()} thread(s), torch {torch.__version__} | "
        f"{m.num_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads} (kv {m.kv_heads}), "
        f"F={m.ffn_hidden_size}, vocab {m.vocab_size}, batch {args.batch} x seq {args.seq} | "
        f"{args.repeats} repeats x {len(batches)} steps after {args.warmup} warm-up | "
        f"{fpt / 1e6:.1f} MFLOP/token, peak {peak / 1e12:.3f} TFLOP/s"
    )
    for name, xs in tps.items():
        med = statistics.median(xs)
        print(
            f"  {name:10s} tokens/s median {med:10.1f} (min {min(xs):.1f}, max {max(xs):.1f}) | "
            f"{med * fpt / 1e12:.3f} TFLOP/s, MFU {med * fpt / peak if peak else 0:.3f} | "
            f"tokens per CPU-second median {statistics.median(cpu[name]):.1f}"
        )
    pairs = [("megaframe", "hf_llama")] + ([("megaframe_fp8", "megaframe")] if "megaframe_fp8" in tps else [])
    for a_name, b_name in pairs:
        for what, d in (("wall", tps), ("CPU time", cpu)):
            ratios = [a / b for a, b in zip(d[a_name], d[b_name])]
            print(
                f"ratio {a_name} / {b_name} ({what}): median {statistics.median(ratios):.3f} "
                f"(per repeat: {', '.join(f'{x:.3f}' for x in ratios)})"
            )


if __name__ == "__main__":
    main()
