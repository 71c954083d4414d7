"""Start-up of a training run, before the first step: model, optimizer, data and resume (set_up), the
checks and header that precede the loop (announce), and the batch loader the loop reads."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megaframe.config import Config, ConfigError
from megaframe.data.dataset import Prefetcher, build_data, microbatches
from megaframe.data.order import resumed_order
from megaframe.evaluation.downstream import Downstream
from megaframe.inference.sampler import Sampler
from megaframe.model.gpt import build_model
from megaframe.optim.build import build_optimizer, cast_model
from megaframe.optim.schedule import schedule_warnings
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh
from megaframe.training.evaluate import Evaluator
from megaframe.training.metrics import flops_per_token
from megaframe.training.phases import PhaseMeter
from megaframe.training.resume import Resumed, resume
from megaframe.training.resume_checks import Accounting


@dataclass
class Setup:
    """What start-up hands the step loop: the model and optimizer, the data, and where the run resumes."""

    model: object
    optimizer: object
    data: object
    evaluator: Evaluator | None
    sampler: Sampler | None
    resumed: Resumed
    acct: Accounting
    phases: PhaseMeter | None = None
    downstream: object = None
    """evaluation/downstream.py's Downstream when train.downstream_interval > 0 (lm-eval and a tokenizer found)."""
    """Peak memory per phase (training/phases.py): start-up and load measured here, step and save by the loop."""


def set_up(cfg: Config, mesh: Mesh, faults=None) -> Setup:
    """Model, optimizer and data; the resume (which may adopt the saved sample order and lr horizon).
    `faults`: MEGAFRAME_INJECT's (training/faults.py), for a fault injected into the resume's load."""
    phases = PhaseMeter(mesh.device)
    # a phase ends on every path: a CPU profiler left running when an error ends the run crashes the
    # interpreter at exit (SIGSEGV instead of exit 2)
    with phases.phase("startup"):
        model = cast_model(build_model(cfg, mesh), cfg.train.precision)
        optimizer = build_optimizer(model, cfg.optim, mesh)
    phases.track(model, optimizer)
    try:
        data = build_data(cfg)
        evaluator = Evaluator.build(cfg, mesh)  # None unless train.eval_interval > 0
        sampler = Sampler.build(cfg, mesh)  # None unless train.sample_interval > 0
        downstream = Downstream.build(cfg, mesh)  # None unless train.downstream_interval > 0
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"data.path={cfg.data.path}: unreadable prepared data ({e})") from e
    if cfg.data.document_mask:
        set_documents(model, data, cfg)
    phases.begin("load")
    try:
        resumed = resume(cfg, model, optimizer, mesh, faults)
    except BaseException:
        phases.end(keep=False)
        raise
    phases.end(keep=resumed.path is not None)
    if resumed.meta:
        data.order = resumed_order(resumed.meta)  # a resumed run keeps the sample order it began with
        adopt_lr_horizon(cfg, resumed.meta)
    if cfg.optim.lr_decay_steps is None:  # a fresh start (or a pre-horizon checkpoint): this run's length
        cfg.optim.lr_decay_steps = cfg.train.max_steps
    acct = Accounting(resumed.step, resumed.consumed if resumed.path else 0, cfg.train.global_batch_size)
    return Setup(model, optimizer, data, evaluator, sampler, resumed, acct, phases, downstream)


def announce(cfg: Config, mesh: Mesh, su: Setup) -> None:
    """What precedes the first step: the first batch's shards checked, the header printed, the config written."""
    start = su.resumed.step
    # before the first step: a corrupt shard is bad input (exit 2 in seconds), not a crash mid-run
    check_first_shards(cfg, mesh, su.data, start, su.acct)
    total_params = global_param_count(su.model, mesh)  # a collective over pp: every rank takes part
    if mesh.rank == 0:
        describe(cfg, mesh, su.model, su.data, start, total_params)
        for line in schedule_warnings(cfg.optim, cfg.train.max_steps):
            print(f"megaframe: warning: {line}", file=sys.stderr, flush=True)
        # after the resume: the config written is the one the run goes on with (lr horizon adopted)
        write_run_config(cfg, start)


def batch_loader(cfg: Config, mesh: Mesh, su: Setup) -> Prefetcher:
    """This rank's micro-batches of each step, read one step ahead."""
    t, start, data = cfg.train, su.resumed.step, su.data
    # positions continue from the consumed samples at the resume (exact even if the batch size changed)
    return Prefetcher(lambda s: microbatches(data, s - 1 - start, t.global_batch_size, t.micro_batch_size,
                                             mesh.dp.rank, mesh.dp.size, t.seed, mesh.device, base=su.acct.base,
                                             cp_rank=mesh.cp.rank, cp_size=mesh.cp.size),
                      start + 1, t.max_steps)


def adopt_lr_horizon(cfg: Config, meta: dict) -> None:
    """The decay horizon of the run being resumed, unless optim.lr_decay_steps is set: the one its
    checkpoint recorded, else (older checkpoints) the train.max_steps it ran with. A step-0 checkpoint
    (an import) has no curve yet, so this run's own length stands."""
    if cfg.optim.lr_decay_steps is not None or int(meta["step"]) == 0:
        return
    saved = meta.get("config", {})
    horizon = saved.get("optim", {}).get("lr_decay_steps") or saved.get("train", {}).get("max_steps")
    if horizon:
        cfg.optim.lr_decay_steps = int(horizon)


def global_param_count(model, mesh: Mesh) -> int:
    """Parameters of the whole model: this stage's global tensors summed over the pipeline stages (the
    header used to count rank 0's stage only, half the model at pp=2). A tied embedding repeated on the
    last stage (pp_duplicate) counts once."""
    mine = sum(math.prod(p.placement.shard.global_shape) for p in model.parameters()
               if not p.placement.pp_duplicate)
    if mesh.pp.size == 1:
        return mine
    # float64 holds any parameter count exactly (below 2^53); read once, at start-up
    return int(comm.all_reduce(torch.tensor([mine], dtype=torch.float64, device=mesh.device), mesh.pp).item())


def write_run_config(cfg: Config, start: int) -> None:
    """${run.dir}/config.yaml is the run's first config and is kept; a resume (which may change settings)
    writes config.resume-<step>.yaml beside it."""
    from omegaconf import OmegaConf

    from megaframe.atomic import write_atomic

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    first = run_dir / "config.yaml"
    # config.yaml is never overwritten: it records how the run began
    path = first if not first.exists() else run_dir / f"config.resume-{start}.yaml"
    write_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # a crash leaves no half config


def set_documents(model, data, cfg: Config) -> None:
    """data.document_mask: the model masks attention at the data's end-of-document ids."""
    if not getattr(data, "eos_ids", None):
        raise ConfigError(f"data.document_mask=true needs an end-of-document id, and data.path={cfg.data.path} "
                          "records none (meta.json eos_id): prepare it again")
    model.set_documents(data.eos_ids)


def data_label(cfg: Config) -> str:
    """What the header calls the data: data.name only where it names this data (the demo group's
    name: demo stays on when data.path points at another corpus), else the prepared folder."""
    d = cfg.data
    if d.kind == "synthetic":
        return "synthetic"
    if d.blend:
        return f"blend of {len(d.blend)} ({', '.join(Path(b.path).name for b in d.blend)})"
    if d.stages:
        return f"{len(d.stages)} stages ({' -> '.join('+'.join(Path(b.path).name for b in s.blend) for s in d.stages)})"
    from megaframe.config import CONF_DIR

    demo = (CONF_DIR.parent / "data" / "demo" / "prepared").resolve()
    if d.name == "demo" and Path(d.path).resolve() != demo:
        return str(d.path)
    return f"{d.name} ({d.path})"


def describe(cfg: Config, mesh: Mesh, model, data, start: int, total: int) -> None:
    """Print the derived sizes once, so a user can check the layout before the first step."""
    m, t = cfg.model, cfg.train
    local = sum(p.numel() for p in model.parameters())
    accum = t.global_batch_size // (t.micro_batch_size * mesh.dp.size)
    print(f"megaframe | run {cfg.run.dir} | {mesh.describe()} sp={cfg.parallel.sp} {zero_label(cfg, mesh)}", flush=True)
    print(f"model {m.name}: {m.num_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads} "
          f"(kv {m.kv_heads}), F={m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}"
          f"{f', {m.num_experts} experts (top-{m.moe_top_k}, F={m.expert_ffn})' if m.num_experts else ''} | "
          f"params {total / 1e6:.2f}M, {local / 1e6:.2f}M on this rank | "
          f"{flops_per_token(m) / 1e6:.1f} MFLOP/token", flush=True)
    print(f"batch {t.global_batch_size} x {m.seq_length} = {t.global_batch_size * m.seq_length} tokens/step, "
          f"micro {t.micro_batch_size}, accumulation {accum} | data {data_label(cfg)}: "
          f"{'endless' if cfg.data.kind == 'synthetic' else data.num_samples} samples | "
          f"steps {start + 1}..{t.max_steps}", flush=True)


def zero_label(cfg: Config, mesh: Mesh) -> str:
    """The ZeRO stage and what it shards over dp (the params count of a ZeRO-3 run reads as if replicated)."""
    o, dp = cfg.optim, mesh.dp.size
    what = {0: "nothing sharded", 1: "optimizer state sharded", 2: "optimizer state and grads sharded",
            3: "optimizer state, grads and params sharded"}[o.zero]
    over = f"groups of {o.shard_group_size} (HSDP)" if o.shard_group_size and o.shard_group_size != dp else f"dp={dp}"
    return f"zero={o.zero} ({what}{'' if o.zero == 0 else f' over {over}'})"


def check_first_shards(cfg: Config, mesh: Mesh, data, start: int, acct: Accounting) -> None:
    """Rank 0 hashes the shards the first global batch reads (megaframe.data.verify: a few shard files,
    not the corpus); every rank hears the verdict, so all of them stop with exit 2 on a corrupt shard."""
    if cfg.data.kind != "prepared":
        return
    err = None
    if mesh.rank == 0:
        from megaframe.data.verify import first_batch_shards, verify

        t0, nbytes = time.perf_counter(), 0
        try:
            for folder, files in first_batch_shards(data, 0, cfg.train.global_batch_size, acct.base,
                                                    cfg.train.seed).items():
                nbytes += verify(folder, files)
            print(f"data: the first batch's shards match their sha256 ({nbytes / 1e6:.1f} MB hashed in "
                  f"{time.perf_counter() - t0:.2f}s)", flush=True)
        except ValueError as e:  # CorruptShard included
            err = f"data: {e}"
    # rank 0 hashed, every rank hears the verdict: all exit 2 together, none starts the first step alone
    err = comm.broadcast_object(err, mesh)
    if err:
        raise ConfigError(err)
