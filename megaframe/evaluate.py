"""Loss and perplexity of a checkpoint on a prepared dataset, in one process (any saved layout).

    python -m megaframe.evaluate CKPT [data.path=DIR] [data.valid_fraction=F] [train.eval_iters=N | N]
                                 [--all] [hydra overrides]

The model comes from the checkpoint (megaframe.load_model); the config is composed like train.py's with
checkpoint.resume=CKPT, so model.* is the checkpoint's. Without data.path / data= / data.blend the run's
own prepared data is used, as its checkpoint records it: its blend, its last stage's blend (what its val_loss
scored) or its data.path, with its data.valid_fraction. With data.valid_fraction > 0 the validation split
is scored (the first train.eval_iters global batches of its seeded order: the samples the run's val_loss
used), else the
whole dataset; --all scores every sample of the split once. A bare integer is train.eval_iters.
Prints one line: loss (mean token cross-entropy, nats), perplexity, tokens. Bad input exits 2.

    python -m megaframe.evaluate checkpoint=CKPT +tasks=hellaswag,arc_easy [+include_path=DIR] [+limit=N]
                                 [+num_fewshot=K] [+batch_size=B] [+tokenizer=PATH]

scores lm-evaluation-harness tasks instead (the optional extra .[eval]; evaluation/lm_eval_adapter.py):
one line per task with its metrics. Under torchrun the checkpoint is scored in the layout the overrides
name (parallel.tp=2 parallel.pp=2 ..., dp the remaining ranks), with the one-process scores.
Both forms take the checkpoint first or as `checkpoint=CKPT` anywhere, and the task options also in lm-eval's
spelling (`--tasks hellaswag --batch_size 4 --tokenizer PATH`); each number is range-checked
(evaluation.lm_tasks.OPTION_RULES: +batch_size >= 1, +num_fewshot >= 0, +limit a fraction or a count).
"""

from __future__ import annotations

import math
import sys
import time

TASK_KEYS = ("tasks", "include_path", "limit", "num_fewshot", "batch_size", "tokenizer")


def split_args(argv: list[str]) -> tuple[str, list[str], bool]:
    """(checkpoint, overrides, --all). Both forms of every command: the checkpoint first or as
    `checkpoint=CKPT` anywhere; lm-eval's options as `+tasks=...` or lm-eval's own `--tasks ...`."""
    argv = _dashed_options(argv)
    named = [a for a in argv if a.lstrip("+").startswith("checkpoint=")]
    if len(named) > 1 or (named and argv and argv[0] is not named[0] and _positional(argv[0])):
        raise ValueError("two checkpoints given: name one, first or as checkpoint=CKPT")
    if named:  # checkpoint=CKPT anywhere: the same as a leading CKPT
        argv = [named[0].split("=", 1)[1]] + [a for a in argv if a is not named[0]]
    if not argv or not _positional(argv[0]):
        raise ValueError(
            "usage: python -m megaframe.evaluate CKPT [overrides] (CKPT first, or checkpoint=CKPT)"
        )
    over = []
    for a in argv[1:]:
        if a == "--all":
            continue
        if a.lstrip("-").isdigit():  # a bare integer, also a negative one the rules then name
            over.append(f"train.eval_iters={a}")
        elif a.startswith("-"):
            raise ValueError(
                f"{a}: not an option of evaluate (--all, key=value overrides, +tasks=... and {KEYS})"
            )
        else:
            over.append(a)
    return argv[0], over, "--all" in argv


KEYS = ", ".join(f"+{k}=" for k in TASK_KEYS)


def _positional(arg: str) -> bool:
    return not arg.startswith("-") and "=" not in arg


def _dashed_options(argv: list[str]) -> list[str]:
    """lm-eval's and generate's spelling (`--tokenizer PATH`, `--batch_size=4`, `--checkpoint CKPT`) as
    the `+key=value` form; the value that follows is taken as is (`--limit -1` is then judged by its rule)."""
    out, rest = [], list(argv)
    while rest:
        a = rest.pop(0)
        key, eq, value = a[2:].partition("=")
        key = key.replace("-", "_")
        if not a.startswith("--") or key not in (*TASK_KEYS, "checkpoint"):
            out.append(a)
        elif eq or rest:
            out.append(f"+{key}={value if eq else rest.pop(0)}")
        else:
            raise ValueError(f"{a}: give its value ({a} VALUE or +{key}=VALUE)")
    return out


def compose(ckpt, step, meta: dict, overrides: list[str]):
    """The run config: overrides + the checkpoint's model and (unless given) the data it trained on, from its
    record (megaframe.data.record): its blend, its last stage's blend (what its val_loss scored) or its
    data.path, with its data.valid_fraction; never the data= preset's data.path of a blend or stages run."""
    from megaframe.config import load_config
    from megaframe.data.kinds import reads_folders
    from megaframe.data.record import run_folders, scored_blend

    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o}
    data = (meta.get("config") or {}).get("data") or {}
    record = meta.get("data") or {}
    extra = []
    given = keys & {"data", "data.path", "data.blend", "data.stages"}
    if not given and reads_folders(data.get("kind", "prepared")):
        blend, folders = scored_blend(meta), run_folders(meta)
        if blend:
            extra.append(
                "data.blend=["
                + ", ".join(f"{{path: {_quoted(b['path'])}, weight: {b['weight']!r}}}" for b in blend)
                + "]"
            )
        elif folders:
            extra.append(f"data.path={_quoted(folders[0])}")
        if extra:
            fraction = record.get("valid_fraction", data.get("valid_fraction", 0.0))
            extra.append(f"data.valid_fraction={float(fraction or 0.0)!r}")
    extra += [f"data.name={data.get('name', 'data')}"] if "data.name" not in keys and data else []
    return load_config(extra + list(overrides) + [f"checkpoint.resume={step}"], world_size=1)


def _quoted(path: str) -> str:
    """A path as a Hydra override value: quoted, so a comma, colon or space in it stays part of it."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _data_paths(data_cfg) -> set[str]:
    """The prepared folders a data config reads, resolved."""
    from megaframe.data.kinds import data_folders
    from megaframe.data.record import resolved

    return {resolved(p) for _, p in data_folders(data_cfg) if p}


def trained_on(meta: dict, cfg) -> str | None:
    """Whether the scored samples may be ones the checkpoint trained on: a warning naming why, else None.
    The held-out documents of fraction f are a prefix of one fixed order (VALID_SEED), so a split of
    f <= the run's data.valid_fraction on the run's data is held out; any other split of that data is not."""
    from megaframe.data.record import held_out_note, run_folders

    if not set(run_folders(meta)) & _data_paths(cfg.data):
        return None  # other data: nothing to say about what the run saw
    run = meta.get("data") or (meta.get("config") or {}).get("data") or {}
    ran, f = float(run.get("valid_fraction") or 0.0), cfg.data.valid_fraction
    return held_out_note(ran, f) if f <= 0 or f > ran else None


def evaluate(model, cfg, every: bool) -> tuple[float, int, str]:
    """(mean token loss, tokens scored, split and which of its samples) over the configured samples."""
    import torch

    from megaframe.data.dataset import BatchShape, microbatches
    from megaframe.parallel.mesh import single_process_mesh
    from megaframe.training.startup import run_samples
    from megaframe.training.validation import loss_sum

    split = "valid" if cfg.data.valid_fraction > 0 else "all"
    data = run_samples(cfg, split=split)
    t = cfg.train
    # whole micro-batches, at most the split's size: a small validation split is still scored
    g = min(t.global_batch_size, data.num_samples) // t.micro_batch_size * t.micro_batch_size
    if g < 1:
        raise ValueError(
            f"the {split} split has {data.num_samples} samples < train.micro_batch_size={t.micro_batch_size}"
        )
    iters = data.num_samples // g if every else min(t.eval_iters, data.num_samples // g)
    mesh = single_process_mesh("cpu")
    total = torch.zeros((), dtype=torch.float64)  # many batches of fp32 sums: keep the digits
    with torch.no_grad():
        for k in range(iters):
            total += loss_sum(
                model, microbatches(data, k, BatchShape(g, t.micro_batch_size, t.seed), mesh), mesh
            ).double()
    tokens = iters * g * cfg.model.seq_length
    # "all" scored 8 KiB of a 1.2M-token corpus: say which samples, not just the split's name
    n = iters * g
    which = (
        f"every sample, {n:,}"
        if n == data.num_samples
        else f"the first {n:,} of {data.num_samples:,} samples"
    )
    return total.item() / tokens, tokens, f"{split}: {which}"


def task_options(overrides: list[str]) -> tuple[dict, list[str]]:
    """The lm-eval options (+tasks=..., +limit=...), their numbers parsed and range-checked
    (evaluation.lm_tasks.OPTION_RULES), and the remaining overrides. ValueError names a bad one."""
    from megaframe.config.keys import take_tool_keys
    from megaframe.evaluation.lm_tasks import check_task_options

    for a in overrides:
        key, eq, value = a.lstrip("+").partition("=")
        if key in TASK_KEYS and eq and not value:  # else the loader calls it "not a config key"
            raise ValueError(f"{a}: give a value (+tasks=hellaswag,arc_easy; {KEYS})")
    opts, rest = take_tool_keys(overrides, TASK_KEYS)
    return check_task_options(opts, lambda key, value: f"+{key}={value}"), rest


def run_tasks(ckpt: str, opts: dict, overrides: list[str]) -> int:
    """Score lm-eval tasks on the checkpoint (under torchrun in the layout the overrides name); one line per
    task on stdout, from the first rank."""
    try:
        from megaframe.evaluation.layout_lm import task_lm
    except ImportError as e:
        raise ValueError(f"+tasks needs lm-eval ({e}): pip install -e '.[eval]'") from None
    from megaframe.evaluation.lm_tasks import format_scores, run_tasks

    t0 = time.perf_counter()
    with task_lm(ckpt, overrides, opts) as (lm, prints):
        scores = run_tasks(
            lm, opts["tasks"], opts.get("include_path"), opts.get("limit"), opts.get("num_fewshot")
        )
    if prints:
        for task, row in sorted(scores.items()):
            print(f"evaluate: {ckpt}: {format_scores({task: row})}", flush=True)
        print(
            f"evaluate: {len(scores)} task(s) in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True
        )
    return 0


def main(argv: list[str]) -> int:
    from megaframe.config import ConfigError
    from megaframe.errors import fail

    if argv[:1] in (["--help"], ["-h"]):
        print(__doc__.strip())
        return 0
    try:
        ckpt, overrides, every = split_args(argv)
        opts, overrides = task_options(overrides)
        if "tasks" in opts:
            return run_tasks(ckpt, opts, overrides)
        if opts:  # scoring perplexity would silently ignore it
            key = next(iter(opts))
            raise ValueError(f"+{key}={opts[key]} is an lm-eval option: add +tasks=TASK,...")
        import megaframe
        from megaframe.inference.files import read_step

        t0 = time.perf_counter()
        # a live run's checkpoint dir: a step pruned while read is read again at the new `latest`
        step, meta, (cfg, model) = read_step(
            ckpt, lambda step, meta: (compose(ckpt, step, meta, overrides), megaframe.load_model(str(step)))
        )
        loss, tokens, split = evaluate(model, cfg, every)
    except (ValueError, ConfigError, OSError) as e:  # ConfigError is a ValueError
        return fail(e)
    seen = trained_on(meta, cfg)
    if seen:
        print(f"megaframe: warning: {seen}", file=sys.stderr, flush=True)
        split += ", trained on"
    d = cfg.data  # a blend is what run_samples reads; the data= preset's data.path stays beside it
    src = "+".join(b.path for b in (d.stages[-1].blend if d.stages else d.blend)) or d.path
    print(
        f"evaluate: {step} (step {meta.get('step')}) on {src} [{split}]: loss {loss:.4f} | "
        # exp overflows past ~709: a diverged model prints a huge but finite perplexity
        f"perplexity {math.exp(min(loss, 700)):.2f} | {tokens} tokens in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
