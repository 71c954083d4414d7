"""One-GPU training throughput of megaframe against compiled peers: transformers' LlamaForCausalLM and
torchtitan's Llama3, same dims, same tokens per optimizer step, same micro-batches per step.

    python benchmarks/bench_gpu.py [--layers 8] [--batch 2] [--seq 2048] [--micro-batches 8] [--steps 3]
                                   [--warmup 2]
                                [--fp8] [--no-compile] [--dry]

Each side trains the llama_1b shape (conf/model/llama_1b.yaml; --layers of its 16) on one device:
- megaframe: its own train_step, train.precision=bf16 (bf16 params, fp32 master and grads in ZeRO-1), blocks
  compiled (train.compile), fused head + cross-entropy;
- hf_llama: LlamaForCausalLM (attn_implementation sdpa, the best transformers has built in), bf16 autocast
  over fp32 params, every decoder layer compiled and the loss compiled, AdamW(fused=True), clip_grad_norm_
  (foreach);
- torchtitan: its Llama3 model code (0.3 config API) with SDPA inner attention (cuDNN first, its own
  priority), blocks compiled with fullgraph, loss compiled, the same optimizer recipe; skipped with one line
  when `import torchtitan` fails (pip install torchtitan).
Every side runs --micro-batches forward/backward passes of --batch x --seq tokens per optimizer step.

Figures per side: tokens/s (median of --repeats), MFU = tokens/s x F / peak with ONE formula for all,
megaframe's flops_per_token: F = 6 N_matmul + 12 L S H E (head counted, embedding not, no causal discount:
torchtitan's and MosaicML's count), peak = the device's dense bf16 rate; peak memory
(torch.cuda.max_memory_allocated); and the step split into its per-micro-batch part (forward + backward) and
its per-step part (zero_grad, clip, update), timed between device syncs in a pass of its own after the rate
(the rate's loop has no sync but its last float(loss)). --fp8: every side float8 too (megaframe
train.precision=fp8; the peers torchao's convert_to_float8_training, tensorwise, head bf16). Each figure's
line names the device and versions. --dry: CPU, tiny dims, no
compile: the harness only (the suite runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_hf import BETAS, CLIP, EPS, LR, WD, make_batches  # noqa: E402

DRY_DIMS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=512,
)


class Clock:
    """Seconds spent in the per-step part of a step, between device syncs (the rest is micro-batches), while
    `on`: only in the split pass, after the rate is timed (a sync inside the timed loop drains the queue and
    exposes the next launches: 4 per step for megaframe's zero_grad and step, 2 for a peer's update)."""

    def __init__(self, device):
        self.device, self.per_step, self.on, self.syncs = device, 0.0, False, 0

    def sync(self):
        self.syncs += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def wrap(self, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            self.sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            self.sync()
            self.per_step += time.perf_counter() - t
            return out

        return timed


def megaframe_side(args, device, clock: Clock, precision: str = "bf16"):
    from megaframe.config import load_config
    from megaframe.config.derived import derive
    from megaframe.model.parallelize import build_for
    from megaframe.parallel.mesh import single_process_mesh
    from megaframe.training.step import optimizer_step

    over = [
        "data=synthetic",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch * args.micro_batches}",
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
        "model=llama_1b",
        f"train.precision={precision}",
        "optim.zero=1",
    ]
    over += (
        [f"model.{k}={v}" for k, v in DRY_DIMS.items()] if args.dry else [f"model.num_layers={args.layers}"]
    )
    cfg = load_config(over, world_size=1, check_data=False)
    mesh = single_process_mesh(device)
    model, opt = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    opt.zero_grad, opt.step = clock.wrap(opt.zero_grad), clock.wrap(opt.step)
    n = [0]

    def step(mbs):
        n[0] += 1
        return optimizer_step(model, opt, mbs, mesh, cfg.optim, derive(cfg, 1), n[0]).loss_sum

    return cfg, step, f"megaframe {precision}"


def _ce_sum(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="sum")


def _peer_step(model, forward, device, clock: Clock, tokens_per_step: int):
    """The usual recipe: bf16 autocast over fp32 params, grads
    accumulated over the micro-batches, clip, fused AdamW."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=True,
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    @clock.wrap
    def update():
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(mbs):
        total = 0.0
        for ids_BS, labels_BS in mbs:
            with autocast:
                loss = forward(ids_BS, labels_BS)
            (loss / tokens_per_step).backward()
            total = total + loss.detach()
        update()
        return total

    return step


def float8_peer(model, recipe: str = "tensorwise") -> int:
    """torchao's float8 training on a peer's linears, as torchtitan's Float8 converter applies it: the output
    head excluded (torchtitan's filter_fqns=["output"]; transformers' lm_head), and linears whose dims are
    not multiples of 16 left bf16. Returns how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(mod, fqn: str) -> bool:
        head = fqn.split(".")[-1] in ("lm_head", "output")
        return not head and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    before = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    convert_to_float8_training(
        model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe)
    )
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear") - before


def hf_side(cfg, args, device, clock: Clock, fp8: bool = False):
    import transformers
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
    with torch.device(device):
        model = LlamaForCausalLM(hc).train()
    label = f"transformers {transformers.__version__}"
    if fp8:
        import torchao

        label += f", torchao {torchao.__version__} float8 tensorwise on {float8_peer(model)} linears"
    loss = _ce_sum
    if args.compile:
        for layer in model.model.layers:
            layer.compile(dynamic=False)
        loss = torch.compile(_ce_sum, dynamic=False)
    step = _peer_step(
        model,
        lambda ids, labels: loss(model(input_ids=ids).logits, labels),
        device,
        clock,
        args.batch * args.seq * args.micro_batches,
    )
    return step, label


def torchtitan_side(cfg, args, device, clock: Clock, fp8: bool = False):
    from functools import partial

    import torchtitan
    from torch import nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3 import _build_llama3_layers as build_layers

    m = cfg.model
    lin = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    blocks = build_layers(
        n_layers=m.num_layers,
        dim=m.hidden_size,
        n_heads=m.num_attention_heads,
        n_kv_heads=m.kv_heads,
        hidden_dim=m.ffn_hidden_size,
        rope=ComplexRoPE.Config(
            dim=m.head_dim, max_seq_len=m.seq_length, theta=m.rope_theta, scaling="llama"
        ),
        attn_backend="flex",
        fuse_qkv=True,
    )
    for b in blocks:  # causal SDPA, as megaframe and transformers run, not flex's block mask
        b.attention.inner_attention = ScaledDotProductAttention.Config()
    tcfg = Llama3Model.Config(
        dim=m.hidden_size,
        vocab_size=m.vocab_size,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(
            num_embeddings=m.vocab_size,
            embedding_dim=m.hidden_size,
            param_init={"weight": partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=m.hidden_size, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=m.hidden_size, out_features=m.vocab_size, param_init=lin),
        layers=blocks,
    )
    with torch.device(device):
        model = tcfg.build()
    if hasattr(model, "init_states"):
        model.init_states(buffer_device=device)
    model.train()
    label = f"torchtitan {getattr(torchtitan, '__version__', '0.3')}"
    if fp8:
        import torchao

        label += f", torchao {torchao.__version__} float8 tensorwise on {float8_peer(model)} linears"
    loss = _ce_sum
    if args.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)
        loss = torch.compile(_ce_sum, dynamic=False)
    step = _peer_step(
        model,
        lambda ids, labels: loss(model(ids), labels),
        device,
        clock,
        args.batch * args.seq * args.micro_batches,
    )
    return step, label


def measure(build, args, device, batches) -> dict:
    """Build a side, run --warmup steps (compiles happen there), then --repeats x --steps timed steps with no
    sync inside (one at the end, `float(loss)`): tokens/s. Then one split pass over the same steps, the
    per-step part (zero_grad, clip, update) timed between syncs: ms per step and per micro-batch."""
    clock = Clock(device)
    step, label = build(clock)
    for mbs in batches[: args.warmup]:
        step(mbs)
    clock.sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    n, tps = len(batches) - args.warmup, []
    syncs = clock.syncs
    for _ in range(args.repeats):
        t = time.perf_counter()
        for mbs in batches[args.warmup :]:
            loss = step(mbs)
        float(loss)  # waits for the device: the one sync of the timed loop
        tps.append(n * args.micro_batches * args.batch * args.seq / (time.perf_counter() - t))
    syncs = (clock.syncs - syncs) / (n * args.repeats)
    clock.on, clock.per_step = True, 0.0
    t = time.perf_counter()
    for mbs in batches[args.warmup :]:
        loss = step(mbs)
    float(loss)
    wall = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {
        "label": label,
        "tps": statistics.median(tps),
        "syncs": syncs,
        "step_ms": 1e3 * clock.per_step / n,
        "mb_ms": 1e3 * (wall - clock.per_step) / n / args.micro_batches,
        "peak_gib": peak,
    }


def free(device) -> None:
    import gc

    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="of llama_1b's 16 (the first GPU run's shape)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=8, help="per optimizer step, every side")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="also every side float8: megaframe train.precision=fp8, the peers torchao's float8 (head bf16)",
    )
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny dims, no compile: the harness only")
    ap.add_argument(
        "--sides",
        default="megaframe,hf_llama,torchtitan",
        help="comma list of megaframe, hf_llama, torchtitan (each one's _fp8 figure comes with --fp8)",
    )
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sides.split(",")) - {"megaframe", "hf_llama", "torchtitan"})
    if unknown:  # else nothing would run and the exit code say success
        print(
            f"bench_gpu: error: --sides {args.sides}: unknown {', '.join(unknown)} "
            "(choose from megaframe, hf_llama, torchtitan)",
            file=sys.stderr,
        )
        return 2
    if args.dry:
        args.seq, args.batch, args.micro_batches, args.steps, args.repeats, args.warmup = 32, 1, 2, 1, 1, 1
        args.compile = False
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    torch.manual_seed(0)
    from megaframe.training.metrics import flops_per_token, peak_flops

    cfg = megaframe_side(args, device, Clock(device))[0]  # the dims every side builds from
    free(device)
    batches = [
        make_batches(args.micro_batches, args.batch, args.seq, cfg.model.vocab_size, device, seed=s)
        for s in range(args.warmup + args.steps)
    ]
    fpt, peak = flops_per_token(cfg.model), peak_flops(device)
    m = cfg.model
    # every figure's line names the device and versions: lines are compared across runs and machines
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    where = f"{name}, torch {torch.__version__}"
    print(
        f"bench_gpu | {device.type} {torch.cuda.get_device_name(0) if device.type == 'cuda' else ''}, torch "
        f"{torch.__version__} | {m.num_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads} "
        f"(kv {m.kv_heads}), F={m.ffn_hidden_size}, vocab "
        f"{m.vocab_size} | {args.micro_batches} micro-batches x "
        f"{args.batch} x {args.seq} tokens per step | compile {args.compile}"
    )
    print(
        f"  MFU = tokens/s x {fpt / 1e9:.4f} GFLOP/token (6 "
        f"N_matmul + 12 L S H E) / peak {peak / 1e12:.1f} TFLOP/s"
    )
    sides = {
        "megaframe": lambda c: megaframe_side(args, device, c)[1:],
        "hf_llama": lambda c: hf_side(cfg, args, device, c),
        "torchtitan": lambda c: torchtitan_side(cfg, args, device, c),
    }
    fp8 = {
        "megaframe_fp8": lambda c: megaframe_side(args, device, c, "fp8")[1:],
        "hf_llama_fp8": lambda c: hf_side(cfg, args, device, c, fp8=True),
        "torchtitan_fp8": lambda c: torchtitan_side(cfg, args, device, c, fp8=True),
    }
    chosen = args.sides.split(",")
    sides = {k: v for k, v in sides.items() if k in chosen}
    if args.fp8:
        sides.update({k: v for k, v in fp8.items() if k.removesuffix("_fp8") in chosen})
    res, failed = {}, False
    for name, build in sides.items():
        try:
            res[name] = r = measure(build, args, device, batches)
        except ImportError as e:  # torchtitan (or transformers) not installed: say so, report the others
            print(f"  {name:13s} SKIP: not importable ({e}); pip install {name.split('_')[0]}")
            continue
        except Exception as e:  # noqa: BLE001 (one side failing must not hide the others' figures)
            print(f"  {name:13s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            failed = True
            continue
        finally:
            free(device)
        mfu = r["tps"] * fpt / peak if peak else float("nan")
        print(
            f"  {name:13s} tokens/s {r['tps']:10.1f} | MFU {mfu:.3f} | peak {r['peak_gib']:.1f} GiB | "
            f"per step {r['step_ms']:.1f} ms + per micro-batch {r['mb_ms']:.1f} ms | "
            f"syncs/step in the timed loop {r['syncs']:.0f} | {r['label']} | {where}"
        )
    pairs = [("megaframe", "hf_llama"), ("megaframe", "torchtitan")]
    pairs += [(f"{s}_fp8", s) for s in ("megaframe", "hf_llama", "torchtitan")]
    pairs += [("megaframe_fp8", "hf_llama_fp8"), ("megaframe_fp8", "torchtitan_fp8")]
    for a, b in pairs:
        if a in res and b in res:
            print(f"ratio {a} / {b}: {res[a]['tps'] / res[b]['tps']:.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
