"""The `megaframe` lm-eval model for `python -m megaframe.evaluate ... +tasks=...`: one process, or under
torchrun the checkpoint loaded into a training layout (parallel.tp / pp of the overrides, dp the rest of
the ranks) on every rank, the scores the same (evaluation/scoring.py splits the requests over dp).
"""

from __future__ import annotations

import contextlib
import datetime

TOKENIZER_OPTION = "+tokenizer=PATH"
"""How evaluate takes a tokenizer: the hint of a missing one names it."""


@contextlib.contextmanager
def task_lm(ckpt: str, overrides: list[str], opts: dict):
    """(lm, whether this rank prints); the process group, when one was started, is ended afterwards."""
    from megaframe.evaluation.lm_eval_adapter import DEFAULT_BATCH, MegaframeLM, load_checkpoint
    from megaframe.parallel.launch import env_ranks

    batch = opts.get("batch_size", DEFAULT_BATCH)
    env = env_ranks()
    if env.world_size == 1:
        model, mesh, tok = load_checkpoint(ckpt, opts.get("tokenizer"), TOKENIZER_OPTION)
        yield MegaframeLM(model=model, mesh=mesh, tok=tok, batch_size=batch), True
        return
    from megaframe.evaluation.downstream import TaskGate, scoring_window
    from megaframe.parallel.launch import shutdown

    try:
        model, mesh, tok = _layout_model(ckpt, overrides, opts.get("tokenizer"), env)
        lm = MegaframeLM.live(model, mesh, tok, int(batch))
        # the tasks agreed over every rank before the first collective: one that fails to load on some
        # ranks only ends every rank with one line naming them, none waits alone in a collective
        gate = TaskGate(mesh, lambda: False)
        lm.scoring = lambda: scoring_window(gate, None, 0)
        try:
            yield lm, mesh.rank == 0
        except Exception as e:
            if not gate.agreed:
                gate.agree(f"{type(e).__name__}: {' '.join(str(e).split())}"[:300])
            raise
        if not gate.agreed:  # nothing to score on this rank: the others must not wait for it
            gate.agree(None)
    finally:
        shutdown()


def _layout_model(ckpt: str, overrides: list[str], tokenizer: str | None, env):
    """This rank's part of the checkpoint's model in the layout the overrides name (fp32), its mesh and the
    run's tokenizer; ValueError/ConfigError on bad input (before any process group exists)."""
    from megaframe.checkpoint import sharded
    from megaframe.config import load_config
    from megaframe.inference.files import check_vocab, find_tokenizer, resolve_step
    from megaframe.model.parallelize import build_model_for
    from megaframe.parallel.launch import dispatch_node, init_distributed, job_hosts, pick_device
    from megaframe.parallel.mesh import build_mesh
    from megaframe.pipeline import p2p

    step, meta = resolve_step(ckpt)
    tok, tok_path = find_tokenizer(step, meta, tokenizer, TOKENIZER_OPTION)
    # checkpoint.resume=STEP: model.* is the checkpoint's; the layout is checked against this world size
    cfg = load_config(
        list(overrides) + [f"checkpoint.resume={step}", "train.precision=fp32"],
        world_size=env.world_size,
        check_data=False,
    )
    check_vocab(tok, tok_path, cfg.model.vocab_size)  # before any process group: one line on every rank
    device = pick_device(cfg.train.device, env.local_rank)
    init_distributed(env, device, cfg.train.dist_timeout_s)
    p = cfg.parallel
    mesh = build_mesh(
        p.tp,
        p.pp,
        device,
        ep=p.ep,
        etp=p.etp,
        cp=p.cp,
        node=dispatch_node(p, env.world_size, hosts=job_hosts(p, env.world_size)),
        shard=cfg.optim.shard_group_size,
        timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s),
    )
    p2p.warm_up(mesh.pp, device)  # before the first forward's transfers, as the trainer does
    model = build_model_for(cfg.model, cfg.parallel, cfg.train, cfg.optim, mesh)
    sharded.load_into(step, model)
    return model.eval(), mesh, tok
