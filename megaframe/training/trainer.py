"""The training run: process group, run lock and the step loop (start-up in startup.py, the logged figures
in meter.py, checkpoints in checkpointing.py). `run(cfg)` is all train.py calls."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from pathlib import Path

from megaframe.config import Config, ConfigError
from megaframe.config.derived import settled
from megaframe.data.dataset import Prefetcher
from megaframe.data.shards import CorruptShard
from megaframe.data.stages import stage_metric
from megaframe.errors import TrainingError  # also re-exported for train.py
from megaframe.layers.rng import seed_step
from megaframe.parallel import comm
from megaframe.parallel.launch import (
    dispatch_node,
    env_ranks,
    init_distributed,
    job_hosts,
    nccl_env,
    pick_device,
    shutdown,
)
from megaframe.parallel.mesh import Mesh, build_mesh
from megaframe.pipeline import p2p
from megaframe.pipeline.schedule import schedule_spec
from megaframe.runops.access.folders import FolderLocks, claim, peer_bad_input, record_bad_input
from megaframe.runops.access.owner import settle
from megaframe.runops.guard import RunGuard
from megaframe.runops.signals import StopFlag
from megaframe.runops.straggler import StragglerProbe
from megaframe.tracking import Tracker
from megaframe.training import run_clock
from megaframe.training.checkpointing import Checkpointer
from megaframe.training.first_step import first_step_limits
from megaframe.training.meter import BadSteps, Meter
from megaframe.training.profiling import Watch
from megaframe.training.run_clock import RunClock
from megaframe.training.startup import Setup, announce, batch_loader, set_up
from megaframe.training.step import StepResult, optimizer_step
from megaframe.training.threads import apply_threads


def run(cfg: Config, stop: StopFlag | None = None) -> None:
    """Train under the ranks of the environment; `stop` is the caller's flag if it installed one early."""
    env = env_ranks()
    apply_threads(cfg.train.threads)  # before any tensor work: torch's default is one thread per core
    device = pick_device(cfg.train.device, env.local_rank)
    init_distributed(env, device, cfg.train.dist_timeout_s, cfg.run.dir)
    try:
        mesh = build_mesh(
            cfg.parallel.tp,
            cfg.parallel.pp,
            device,
            ep=cfg.parallel.ep,
            etp=cfg.parallel.etp,
            cp=cfg.parallel.cp,
            node=dispatch_node(cfg.parallel, env.world_size, hosts=job_hosts(cfg.parallel, env.world_size)),
            timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s),
            world_timeout=datetime.timedelta(seconds=cfg.checkpoint.save_timeout_s),
            shard=cfg.optim.shard_group_size,
            # an overlapped kind runs a forward and a backward at once, each on its own communicators
            lanes=2 if schedule_spec(cfg.parallel.pp_schedule, cfg.parallel.vpp).overlap else 1,
        )
        # before anything else talks over pp: NCCL builds a pair's channel at its first transfer, and ranks
        # first meeting in different schedule phases can deadlock
        p2p.warm_up(mesh.pp, device)
        # ranks may have resolved a timestamped run name a second apart: rank 0's wins; the run id
        # (this launch of the run, recorded in each checkpoint's lineage) is rank 0's too
        run_id = f"{cfg.run.name}@{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
        name, run_dir, ckpt_dir, tb_dir, run_id = comm.broadcast_object(
            (cfg.run.name, cfg.run.dir, cfg.checkpoint.dir, cfg.logging.tensorboard.dir, run_id), mesh
        )
        tb = dataclasses.replace(cfg.logging.tensorboard, dir=tb_dir)
        cfg = settled(
            cfg, run={"name": name, "dir": run_dir}, checkpoint={"dir": ckpt_dir}, logging={"tensorboard": tb}
        )
        lock = take_run_dir(cfg, mesh)
        try:
            if device.type == "cuda" and env.world_size > 1:
                nccl_env(cfg.run.dir)  # the agreed run folder for the flight recorder's dumps
                (Path(cfg.run.dir) / "nccl_trace").mkdir(parents=True, exist_ok=True)
            try:
                train(cfg, mesh, stop or StopFlag(), run_id, lock.owner)
            except (ConfigError, TrainingError):
                raise
            except Exception as e:  # a broken collective: a peer that found bad input mid-run left its line
                line = peer_bad_input(cfg.run.dir)
                if line is None:
                    raise
                raise ConfigError(line) from e
        finally:
            lock.release()
    finally:
        shutdown()


def take_run_dir(cfg: Config, mesh: Mesh) -> FolderLocks:
    """Rank 0 probes and locks every folder the run writes (run.dir, checkpoint.dir) before anything is
    written there, then settles the run's identity (runops/access/owner.py); every rank hears the outcome and
    the id, so all of them exit 2 when a folder cannot be written, another live job holds it or another run
    owns checkpoint.dir's checkpoints."""
    locks, err = FolderLocks(), None
    if mesh.rank == 0:
        try:
            locks = claim(cfg.run, cfg.checkpoint, cfg.logging)
            locks.owner = settle(cfg.run, cfg.checkpoint)
        except ConfigError as e:
            locks.release()
            err = str(e)
    # every rank reaches the broadcast whatever rank 0 found, so none goes on alone into the run folder
    err, locks.owner = comm.broadcast_object((err, locks.owner), mesh)
    if err:
        raise ConfigError(err)
    return locks


def train(cfg: Config, mesh: Mesh, stop: StopFlag, run_id: str = "", owner: str = "") -> None:
    """Start-up (startup.py), then the step loop to train.max_steps or a stop, on every rank:
    batches -> step -> save -> evaluate -> decide -> meter -> (a stop's or timed save) -> stop.

    A step due a save is saved before its evaluation: a crash or a hang kill while validating, sampling or
    scoring it never repeats at the same step on a restart (the restart resumes after it)."""
    clock = RunClock(run_id)  # goodput: this incarnation's wall time by bucket (training/run_clock.py)
    guard = RunGuard(cfg.train, mesh, stop, cfg.run.dir, cfg.run.name)
    su = set_up(cfg, mesh, guard.faults, run_id)
    clock.phase("setup")
    cfg = su.cfg  # the LR horizon settled: what the loop, the saves and config.yaml use
    start = su.resumed.step
    if start >= cfg.train.max_steps:  # a resume with nothing left: one line, no header, no lr warnings, rc 0
        if mesh.rank == 0:
            print(
                f"megaframe: already at step {start} >= train.max_steps={cfg.train.max_steps}; nothing to "
                "train (raise train.max_steps)",
                flush=True,
            )
        return
    announce(cfg, mesh, su)
    loop = None
    try:  # the guard closes (watchdog stopped, handlers restored) however the loop ends or fails to start
        loop = Loop(cfg, mesh, su, guard, (run_id, owner), clock)
        step = start
        for step in range(start + 1, cfg.train.max_steps + 1):
            res = loop.step(step, loop.batches(step))
            saved = loop.save(step, save_due(cfg, step, False), last=step == cfg.train.max_steps)
            val, evaluated = loop.evaluate(step)
            # the same steps on every rank; after an evaluation too: a signal during it stops here
            stopping, timed = guard.decide(step, start, loop.ckpt, evaluated)
            loop.meter(step, res, val, stopping)
            if not saved:
                loop.save(step, stopping or timed, last=stopping)
            if stopping:
                guard.report_stop(step)
                break
        loop.finish(start, step)
    finally:
        if loop is not None:
            loop.close()
        guard.close()


class Loop:
    """The step loop's parts, built after start-up: tracker, meter, bad-step counter, checkpointer and
    the batch loader; one method per verb of train()."""

    def __init__(self, cfg: Config, mesh: Mesh, su: Setup, guard: RunGuard, ids: tuple[str, str], clock):
        self.cfg, self.mesh, self.su, self.guard, self.start = cfg, mesh, su, guard, su.resumed.step
        self.clock = clock
        clock.resumed(self.start, cfg.run.dir, mesh.is_logger)
        overlapped = schedule_spec(cfg.parallel.pp_schedule, cfg.parallel.vpp).overlap  # a worker thread too
        self.watch = Watch(cfg.train, cfg.run.dir, mesh, guard.probe, all_threads=overlapped)
        self.tracker = Tracker(cfg, cfg.run.dir, mesh.is_logger, cfg.train.max_steps, ids[1], self.start)
        self.meters = Meter(cfg.model, su.derived, mesh, su.acct)
        # on CUDA the grad norms are read (a host sync) only at log steps; on CPU reading is free
        self.bad = BadSteps(cfg.train.max_bad_steps, mesh.rank == 0, defer=mesh.device.type == "cuda")
        watchdog = guard.watch()
        self.ckpt = Checkpointer(cfg, mesh, ids, su.resumed, su.acct, watchdog, guard.faults, su.data)
        self.loader = batch_loader(cfg, mesh, su)
        self.scores: dict = {}  # downstream/<task>/<metric> of this step (evaluation/downstream.py)
        # the first row after a resume names the checkpoint (readers see where the run restarted)
        self.marker = (
            {"resumed_from": str(su.resumed.path), "resumed_step": self.start, "run_id": ids[0]}
            if su.resumed.path
            else {}
        )

    def batches(self, step: int) -> list:
        """The step's micro-batches (read while the previous step computed); the guard hears the step."""
        self.guard.beat(step)
        self.clock.first_step()  # start-up ends at the first step's start
        # dropout RNG: equal on tp ranks, a function of the step
        seed_step(self.cfg.train.seed, step, self.mesh)
        with self.clock.timing("data_wait"):
            return next_batches(self.loader, step, self.cfg.run.dir)

    def step(self, step: int, batches: list) -> StepResult:
        """One optimizer step, counted, its grad norm checked (too many bad steps in a row end the run)."""
        t, su = self.cfg.train, self.su
        # the first step compiles: slow, not hung
        limits = (
            first_step_limits(self.mesh, self.guard.watchdog, t.compile_timeout_s, t.dist_timeout_s)
            if t.compile and step == self.start + 1
            else contextlib.nullcontext()
        )
        # the first step's peak (grads and moments appear in it); a profiled step in the profiler
        with self.clock.timing("step"), self.watch.step(step), limits, su.phases.phase("step"):
            res = optimizer_step(
                su.model, su.optimizer, batches, self.mesh, self.cfg.optim, su.derived, step, self.guard.probe
            )
        self.meters.add(res)
        try:
            self.bad.check(step, res.grad_norm, flush=step % t.log_interval == 0 or step == t.max_steps)
        except TrainingError as e:
            raise TrainingError(f"{e}; {self.ckpt.resume_hint()}") from e
        return res

    def evaluate(self, step: int) -> tuple[float | None, bool]:
        """(the validation loss when due, else None; whether anything ran: validation, samples or
        downstream scores, each under the guard's `between`). Downstream scores join the step's row."""
        with self.clock.timing("eval"):
            val, sampled = evaluate_and_sample(
                self.su, self.meters, self.tracker, step, self.cfg.run.dir, self.guard
            )
            self.scores, scored = downstream_scores(self.su, self.meters, step, self.guard)
        return val, val is not None or sampled or scored

    def meter(self, step: int, res: StepResult, val: float | None, stopping: bool) -> None:
        """The metrics row at log steps, built on every rank (the dp loss all-reduce and MoE figures are
        collectives); step 1 says the run is alive; the stop step's loss is the one the checkpoint holds."""
        t = self.cfg.train
        if (
            step % t.log_interval == 0
            or step in (1, t.max_steps)
            or val is not None
            or self.scores
            or stopping
        ):
            row = log_row(self.su, self.meters, self.guard.probe, self.ckpt, self.mesh, step, res, val)
            if self.mesh.is_logger:  # goodput/* summed over the folder's incarnations, and this one's clock
                row.update(self.clock.row(step))
            self.tracker.log({**row, **self.scores, **self.marker}, self.start)
            self.marker = {}

    def save(self, step: int, due: bool, last: bool) -> bool:
        """Checkpoint `step` when `due` (`last`: the run's last save: synchronous, and its failure ends the
        run); whether it saved (written, or writing in the background). A stop after a save that failed
        (on_save_error=continue) or was refused tries once more, as the run's last."""
        if not due:
            return False
        self.bad.flush()  # a deferred grad-norm read: the save must know whether this step was skipped
        # its traffic is not the step's; its limit is checkpoint.save_timeout_s (Checkpointer.save)
        with (
            self.clock.timing("checkpoint"),
            self.guard.between(f"checkpoint save at step {step}"),
            self.su.phases.phase("save"),
        ):
            return self.ckpt.save(self.su.model, self.su.optimizer, step, last, self.bad.in_a_row)

    def finish(self, start: int, step: int) -> None:
        """The background save committed, the memory phases and the run's summary printed."""
        with self.clock.timing("checkpoint"):
            self.ckpt.finish(step)
        # every phase's peak, a stop's save after the last row
        if self.mesh.is_logger and self.su.phases.figures:
            print(self.su.phases.summary(), flush=True)
        goodput = run_clock.summary(self.clock.row(step)) if self.mesh.is_logger else ""
        self.meters.report(start, step, self.ckpt.last_saved, goodput)

    def close(self) -> None:
        self.watch.close()
        self.loader.close()
        self.tracker.finish()


def log_row(
    su: Setup,
    meter: Meter,
    probe: StragglerProbe,
    ckpt: Checkpointer,
    mesh: Mesh,
    step: int,
    res,
    val: float | None,
) -> dict:
    """The step's metrics row, built on every rank: the dp loss all-reduce and MoE figures are collectives."""
    figures = meter.metrics(step, res, su.model, su.optimizer)
    row = {
        **figures,
        **probe.gather(mesh, step, figures["step_time_s"]),
        **ckpt.take_io(),
        **stage_metric(su.data, su.acct.consumed(step)),
        **su.phases.take(),
    }
    if val is not None:
        row["val_loss"] = meter.last["val_loss"] = val
    return row


def next_batches(loader: Prefetcher, step: int, run_dir: str) -> list:
    """The step's micro-batches; a shard found corrupt mid-run is bad input too (exit 2), recorded for the
    peers, which did not read it (folders.BAD_INPUT)."""
    try:
        return loader.get(step)
    except CorruptShard as e:
        raise ConfigError(record_bad_input(run_dir, str(e))) from e


def evaluate_and_sample(
    su: Setup, meter: Meter, tracker: Tracker, step: int, run_dir: str, guard: RunGuard
) -> tuple[float | None, bool]:
    """(the validation loss when evaluation is due, else None; whether samples were written): both off the
    clock, each batch or token a beat of the hang watchdog."""
    val, sampled = None, False
    if su.evaluator is not None and su.evaluator.due(step):
        t0 = time.perf_counter()
        with guard.between(f"validation at step {step}"):
            val = su.evaluator.evaluate(su.model, guard.progress)
        meter.paused(time.perf_counter() - t0)  # tokens_per_s counts training time only
    if su.sampler is not None and su.sampler.due(step):  # sampling time is not training time either
        with guard.between(f"sampling at step {step}"):
            meter.paused(su.sampler.sample(step, su.model, run_dir, tracker.wandb_run, guard.progress))
        sampled = True
    return val, sampled


def downstream_scores(su: Setup, meter: Meter, step: int, guard: RunGuard) -> tuple[dict, bool]:
    """(downstream/<task>/<metric> when downstream evaluation is due, else {}; whether it was due), off the
    clock; each task agreed over the ranks, each scored batch a beat of the hang watchdog."""
    if su.downstream is None or not su.downstream.due(step):
        return {}, False
    with guard.between(f"downstream scoring at step {step}"):
        row, seconds = su.downstream.score(step, su.model, guard.watchdog, guard.signalled)
    meter.paused(seconds)  # tokens_per_s counts training time only
    return row, True


def save_due(cfg: Config, step: int, stopping: bool) -> bool:
    """Every checkpoint.interval steps, and at the run's last step (the end, or a stop); the timed saves
    (checkpoint.interval_minutes) are decided at the check steps, together (StopFlag.decide)."""
    interval = cfg.checkpoint.interval
    return bool(interval and step % interval == 0) or step == cfg.train.max_steps or stopping
