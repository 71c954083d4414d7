"""Start-up of a training run, before the first step: model, optimizer, data and resume (set_up), the
checks and header that precede the loop (announce), and the batch loader the loop reads."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from megaframe.checkpoint.resume import Resumed, resume
from megaframe.checkpoint.resume_checks import Accounting, resume_position
from megaframe.config import Config, ConfigError
from megaframe.config.derived import Derived, derive, lr_horizon, settled
from megaframe.data.dataset import BatchShape, Prefetcher, microbatches
from megaframe.data.kinds import Samples, build_samples, data_folders
from megaframe.data.order import resumed_order
from megaframe.evaluation.downstream import Downstream
from megaframe.inference.sampler import Sampler
from megaframe.model.gpt import GPT
from megaframe.model.parallelize import build_for
from megaframe.optim.lr_schedule import schedule_warnings
from megaframe.optim.protocol import Optimizer
from megaframe.parallel import agreement, comm
from megaframe.parallel.launch import local_world_size
from megaframe.parallel.mesh import Mesh
from megaframe.training.header import describe, precision_warnings
from megaframe.training.phase_meter import PhaseMeter
from megaframe.training.threads import busy_machine_warning, oversubscribed_warning, pick_threads
from megaframe.training.validation import Evaluator


def run_samples(cfg: Config, split: str = "train") -> Samples:
    """The run's samples of a split (data/kinds.py: build_samples on the run's groups)."""
    m, t = cfg.model, cfg.train
    return build_samples(cfg.data, m.seq_length, m.vocab_size, t.seed, t.global_batch_size, split)


@dataclass
class Setup:
    """What start-up hands the step loop: the model and optimizer, the data, and where the run resumes."""

    model: GPT
    optimizer: Optimizer
    data: Samples
    evaluator: Evaluator | None
    sampler: Sampler | None
    resumed: Resumed
    acct: Accounting
    phases: PhaseMeter | None = None
    """Peak memory per phase (training/phase_meter.py): start-up
    and load measured here, step and save by the loop."""
    downstream: object = None
    """evaluation/downstream.py's Downstream when
    train.downstream_interval > 0 (lm-eval and a tokenizer found)."""
    cfg: Config | None = None
    """The config the run goes on with: the loaded one, the LR horizon a resume adopts settled into it."""
    derived: Derived | None = None
    """Values worked out from `cfg` once (config/derived.py): schedule kind, micro-batches, LR horizon, ..."""


def set_up(cfg: Config, mesh: Mesh, faults=None, run_id: str = "") -> Setup:
    """Model, optimizer and data; the resume (which may adopt the saved sample order and lr horizon).
    `faults`: MEGAFRAME_INJECT's (runops/faults.py), for a fault injected into the resume's load."""
    phases = PhaseMeter(mesh.device)
    # a phase ends on every path: a CPU profiler left running when an error ends the run crashes the
    # interpreter at exit (SIGSEGV instead of exit 2)
    with phases.phase("startup"):
        model, optimizer = build_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    phases.track(model, optimizer)
    error = None
    try:
        data = run_samples(cfg)
        valid = partial(run_samples, cfg, split="valid")
        # each None unless its train.*_interval > 0
        evaluator = Evaluator.build(cfg.train, mesh, valid, cfg.model.seq_length)
        sampler = Sampler.build(cfg.train, cfg.data, mesh)
    except (OSError, ValueError, KeyError) as e:
        # the key the run reads: a blend or stages run never read the data= preset's data.path
        d = cfg.data
        key = "data.stages" if d.stages else "data.blend" if d.blend else f"data.path={d.path}"
        error = f"{key}: unreadable prepared data ({e})"
    # agreed before any other collective: a node that cannot read the data (or the validation split, or the
    # tokenizer) ends every rank with its line, instead of leaving the others waiting in the resume's
    failed = agreement.agree(error, mesh.group)
    if failed:
        raise ConfigError(agreement.named_failures(failed, mesh.world))
    downstream = Downstream.build(cfg.train, cfg.data, mesh)  # optional: agreed inside, all score or none
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
    # recorded in config.yaml and every checkpoint: a later resume keeps the first start's LR curve
    cfg = settled(cfg, optim={"lr_decay_steps": lr_horizon(cfg.optim, cfg.train, resumed.meta)})
    # counted in this run's samples: a RoPE resume at another seq_length goes on at the same token count
    base, tokens = resume_position(resumed.meta, cfg.model.seq_length) if resumed.path else (0, 0)
    acct = Accounting(resumed.step, base, cfg.train.global_batch_size, cfg.model.seq_length, tokens)
    return Setup(
        model,
        optimizer,
        data,
        evaluator,
        sampler,
        resumed,
        acct,
        phases,
        downstream=downstream,
        cfg=cfg,
        derived=derive(cfg, mesh.world, resumed.meta, run_id),
    )


def announce(cfg: Config, mesh: Mesh, su: Setup) -> None:
    """What precedes the first step: the first batch's shards
    checked, the header printed, the config written."""
    start = su.resumed.step
    # before the first step: a corrupt shard is bad input (exit 2 in seconds), not a crash mid-run
    check_first_shards(cfg, mesh, su.data, start, su.acct)
    total_params = global_param_count(su.model, mesh)  # a collective over pp: every rank takes part
    if mesh.rank == 0:
        # what trainer.run applied (the same rule, the same environment)
        threads = pick_threads(cfg.train.threads)
        describe(cfg, mesh, su, total_params, threads)
        busy = busy_machine_warning(threads.count)
        over = oversubscribed_warning(threads, local_world_size())
        for line in [
            *schedule_warnings(cfg.optim, cfg.train.max_steps),
            *precision_warnings(cfg, mesh.device.type),
            *([busy] if busy else []),
            *([over] if over else []),
        ]:
            print(f"megaframe: warning: {line}", file=sys.stderr, flush=True)
        # after the resume: the config written is the one the run goes on with (lr horizon adopted)
        write_run_config(cfg, start)


def batch_loader(cfg: Config, mesh: Mesh, su: Setup) -> Prefetcher:
    """This rank's micro-batches of each step, read one step ahead."""
    t, start, data = cfg.train, su.resumed.step, su.data
    # positions continue from the consumed samples at the resume (exact even if the batch size changed)
    shape = BatchShape(t.global_batch_size, t.micro_batch_size, t.seed, base=su.acct.base)
    return Prefetcher(
        lambda s: microbatches(data, s - 1 - start, shape, mesh),
        start + 1,
        t.max_steps,
    )


def global_param_count(model, mesh: Mesh) -> int:
    """Parameters of the whole model: this stage's global tensors summed over the pipeline stages (the
    header used to count rank 0's stage only, half the model at pp=2). A tied embedding repeated on the
    last stage (pp_duplicate) counts once."""
    mine = sum(
        math.prod(p.placement.shard.global_shape) for p in model.parameters() if not p.placement.pp_duplicate
    )
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
    try:
        write_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # a crash leaves no half config
    # a full run.dir: a record of the settings is not worth the run (the checkpoint has them)
    except OSError as e:
        print(f"megaframe: warning: cannot write {path} ({e}); training goes on", file=sys.stderr, flush=True)


def set_documents(model, data, cfg: Config) -> None:
    """data.document_mask: the model masks attention at the data's end-of-document ids."""
    if not getattr(data, "eos_ids", None):
        raise ConfigError(
            f"data.document_mask=true needs an end-of-document id, and data.path={cfg.data.path} "
            "records none (meta.json eos_id): prepare it again"
        )
    model.set_documents(data.eos_ids)


def check_first_shards(cfg: Config, mesh: Mesh, data, start: int, acct: Accounting) -> None:
    """Rank 0 hashes the shards the first global batch reads (megaframe.data.verify: a few shard files,
    not the corpus); every rank hears the verdict, so all of them stop with exit 2 on a corrupt shard."""
    # a kind reading no folder has no shard to hash (every rank asks the same config)
    if not data_folders(cfg.data):
        return
    err = None
    if mesh.rank == 0:
        from megaframe.data.verify import first_batch_shards, verify

        t0, nbytes = time.perf_counter(), 0
        try:
            for folder, files in first_batch_shards(
                data, 0, cfg.train.global_batch_size, acct.base, cfg.train.seed
            ).items():
                nbytes += verify(folder, files)
            print(
                f"data: the first batch's shards match their sha256 ({nbytes / 1e6:.1f} MB hashed in "
                f"{time.perf_counter() - t0:.2f}s)",
                flush=True,
            )
        except ValueError as e:  # CorruptShard included
            err = f"data: {e}"
    # rank 0 hashed, every rank hears the verdict: all exit 2 together, none starts the first step alone
    err = comm.broadcast_object(err, mesh)
    if err:
        raise ConfigError(err)
