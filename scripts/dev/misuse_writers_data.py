"""Attempts of scripts/dev/misuse_rerun.py on who writes a folder and what a run trained on: concurrent
writers (ids L*, CW*), the data a run records and a resume compares (W*, DI*), prepared-data and checkpoint
checksums (T3, W5, CS*), and the HF import's inputs (W6, T4). Ids L1-W8/T3/T4/K3 reproduce the documented
defects of these subjects with the fixed behaviour as the expected outcome; CW, DI and CS are further
attempts of the same classes."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file

from scripts.dev.misuse_base import GEN, RACE, TINY, TRAIN, Attempt, Setup, cfg, sh
from scripts.dev.misuse_datasets import (
    CKPT_VERIFY,
    PREPARE,
    VERIFY,
    Data,
    edit_json,
    first_shard,
    spec,
    truncate,
)
from scripts.dev.misuse_writers_identity import (
    EVAL,
    EXPORT,
    IMPORT,
    checksums,
    concurrent_writers,
    data_identity,
)


def _tok_entries(out) -> int:
    return len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])


def _export_check(out, vocab: int):
    def check():
        got = (json.loads((out / "config.json").read_text())["vocab_size"], _tok_entries(out))
        return (
            None if got == (vocab, vocab) else f"exported vocab_size, tokenizer entries = {got}, not {vocab}"
        )

    return check


def lock_and_prepare_repros(s: Setup, d: Data) -> list[Attempt]:
    w = s.work
    corpus, tok = s.data.parent / "corpus", s.data / "tokenizer.model"
    prep = [*PREPARE, f"data.source={corpus}", f"data.tokenizer={tok}"]

    def race_prep(name, first, cmds):
        out, spec_file = w / "data" / name, w / f"{name}.json"

        def prep_():
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.parent / f".{name}.partial", ignore_errors=True)
            if first:
                sh([*prep, f"data.path={out}", *first])
            # between them the writers cover every unit: OUT must be published, and complete
            spec(spec_file, [[*prep, f"data.path={out}", *c] for c in cmds], None, [[*VERIFY, str(out)]])

        return Attempt(
            name[:2].upper() + name[2:],
            "lost work",
            [*RACE, "cmds", str(spec_file)],
            rc=0,
            prep=prep_,
            timeout=600,
        )

    return [
        Attempt(
            "L1-pid",
            "lost work",
            [*RACE, "locks", str(w / "l1pid"), "25"],
            rc=0,
            timeout=300,
            prep=lambda: shutil.rmtree(w / "l1pid", ignore_errors=True),
        ),
        Attempt(
            "L1-squeue",
            "lost work",
            [*RACE, "locks", str(w / "l1sq"), "4", "--squeue"],
            rc=0,
            timeout=300,
            prep=lambda: shutil.rmtree(w / "l1sq", ignore_errors=True),
        ),
        race_prep(
            "l2-tasks",
            ["data.num_tasks=2", "data.task=0", "data.num_workers=1"],
            [
                ["data.num_tasks=2", "data.task=1", "data.num_workers=2"],
                ["data.num_tasks=4", "data.task=2", "data.num_workers=1"],
            ],
        ),
        race_prep(
            "l2-plain",
            None,
            [["data.num_workers=2"], ["data.num_tasks=2", "data.task=1", "data.num_workers=1"]],
        ),
    ]


def data_record_repros(s: Setup, d: Data) -> list[Attempt]:
    """W1-W4, W7, W8, K3: the run's own data decides the tools' tokenizer and data, the vocabulary, a
    resume's comparison and a dataset's identity."""
    w = s.work
    hf1, hf7 = w / "w1-hf-blend", w / "w1-hf-stages"
    moved = w / "data" / "d512mv"

    def moved_run():
        ck = d.trained("w1-moved", f"data.blend=[{{path: {d.copy('d512mv', 'docs512')}, weight: 1}}]")
        shutil.rmtree(w / "data" / "d512mv.gone", ignore_errors=True)
        moved.rename(w / "data" / "d512mv.gone")
        return ck

    out = [
        Attempt(
            "W1-blendexp",
            "silently wrong",
            [*EXPORT, str(w / "w1-blend" / "checkpoints"), str(hf1), "--force"],
            rc=0,
            prep=lambda: d.trained("w1-blend", d.blend(("docs512", 1))),
            check=_export_check(hf1, 512),
        ),
        Attempt(
            "W1-stagesexp",
            "silently wrong",
            [*EXPORT, str(w / "wd-stages" / "checkpoints"), str(hf7), "--force"],
            rc=0,
            prep=d.stages_run,
            check=_export_check(hf7, 512),
        ),
        Attempt(
            "W1-eval",
            "silently wrong",
            [*EVAL, str(w / "w1-ddemo" / "checkpoints"), "train.eval_iters=1"],
            rc=0,
            prep=lambda: d.trained("w1-ddemo", d.blend(("docsdemo", 1))),
            has=(str(w / "data" / "docsdemo"),),
            lacks=("demo/prepared",),
        ),
        Attempt(
            "K3-eval",
            "message",
            [*EVAL, str(w / "wd-stages" / "checkpoints"), "train.eval_iters=1"],
            rc=0,
            prep=d.stages_run,
            lacks=("demo/prepared", "data.path="),
        ),
        Attempt(
            "W1-movedgen",
            "silently wrong",
            [
                *GEN,
                str(w / "w1-moved" / "checkpoints"),
                "--prompt",
                "The",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
            ],
            rc=(0, 2),
            prep=moved_run,
            lacks=("demo/prepared/tokenizer.model",),
        ),
        Attempt(
            "W2",
            "silently wrong",
            [*CKPT_VERIFY, str(w / "wd-stages" / "checkpoints")],
            rc=0,
            prep=d.stages_run,
            check=lambda: _vocab_of(w / "wd-stages" / "checkpoints", 512),
        ),
        Attempt(
            "W3-stages",
            "silently wrong",
            d.run("wd-stages", d.stages(first_until=1), steps=4),
            prep=d.stages_run,
            has=("data.stages",),
        ),
        Attempt(
            "W3-valid",
            "silently wrong",
            s.run_tiny("w3valid", "train.max_steps=7", "data.valid_fraction=0.1", "train.eval_interval=2"),
            prep=lambda: s.copy("w3valid", "run"),
            has=("data.valid_fraction",),
        ),
        Attempt(
            "W3-blend",
            "silently wrong",
            d.run("wd-blend", d.blend(("docs512", 0.9), ("scr512", 0.1)), steps=3),
            prep=d.blend_run,
            has=("data.blend",),
        ),
        Attempt(
            "W4-stages",
            "silently wrong",
            d.run(
                "w4st",
                f"data.stages=[{{until_step: 1, blend: [{{path: {s.data}, weight: 1}}]}}, "
                f"{{blend: [{{path: {s.data}/, weight: 1}}]}}]",
            ),
            rc=0,
            check=lambda: _one_source(w / "w4st" / "checkpoints"),
        ),
        Attempt(
            "W4-blend",
            "silently wrong",
            *cfg(
                f"data.blend=[{{path: {s.data}, weight: 1}}, {{path: {s.data}/./, weight: 1}}]",
                rc=2,
                has=("is the folder of",),
                synthetic=False,
            )[:2],
        ),
        Attempt(
            "W7",
            "silently wrong",
            *cfg(
                f"data.stages=[{{until_step: -3, blend: [{{path: {s.data}}}]}}, "
                f"{{blend: [{{path: {s.data}}}]}}]",
                rc=2,
                synthetic=False,
            )[:2],
        ),
    ]
    return out + [_w8(s), _k3_inside(s, d)]


def _vocab_of(ck, want: int) -> str | None:
    head = ck / (ck / "latest").read_text().strip()
    got = json.loads((head / "metadata.json").read_text())["config"]["model"]["vocab_size"]
    return None if got == want else f"model.vocab_size={got}, the stages' data has {want}"


def _one_source(ck) -> str | None:
    head = ck / (ck / "latest").read_text().strip()
    srcs = json.loads((head / "metadata.json").read_text()).get("data", {}).get("sources") or []
    paths = {x.get("path") for x in srcs if isinstance(x, dict)}
    if len(paths) == 1:
        return None
    return f"one folder recorded as {len(paths)} data sets: {sorted(map(str, paths))}"


def _w8(s: Setup) -> Attempt:
    """A folder another run continued on purpose, then its own run id deleted: no owner is adopted."""
    a = s.p("w8a")

    def prep():
        ck = s.copy("w8a", "run")
        sh(s.run_tiny("w8b", f"checkpoint.resume={ck}", f"checkpoint.dir={ck}", "train.max_steps=7"))
        (a / "megaframe.run_id").unlink()

    return Attempt(
        "W8",
        "silently wrong",
        s.run_tiny("w8a", "train.max_steps=9"),
        prep=prep,
        has=("belongs to another run",),
    )


def _k3_inside(s: Setup, d: Data) -> Attempt:
    """prepare's output inside its source: an identical re-run does nothing (it does not read its output)."""
    src = s.work / "k3src"

    def prep():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        for f in sorted(d.source("docs").glob("*.md"))[:3]:
            shutil.copy(f, src / f.name)
        sh(cmd)

    cmd = [
        *PREPARE,
        f"data.source={src}",
        f"data.path={src / 'prepared'}",
        "data.num_workers=1",
        f"data.tokenizer={s.data / 'tokenizer.model'}",
    ]
    return Attempt("K3-inside", "message", cmd, rc=0, prep=prep, has=("nothing to do",))


def file_repros(s: Setup, d: Data) -> list[Attempt]:
    """T3, W5 (prepared data files), W6, T4 (the HF import's inputs)."""
    w = s.work

    def strings(name):
        def prep():
            edit_json(
                d.copy(name, "docs512") / "meta.json",
                lambda m: m.update(shards=[x["file"] for x in m["shards"]]),
            )

        return prep

    def docs_entry(name, value):
        def prep():
            import numpy as np

            f = first_shard(d.copy(name, "docs512"), "docs")
            a = np.load(f)
            a[len(a) // 2] = value
            np.save(f, a)

        return prep

    def hf_damage(name, fn):
        def prep():
            f = d.hf_copy(name) / "model.safetensors"
            tensors = load_file(f)
            fn(tensors)
            save_file(tensors, f, metadata={"format": "pt"})

        return prep

    def nan(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")

    data512 = w / "data"
    return [
        Attempt("T3-verify", "traceback", [*VERIFY, str(data512 / "t3a")], prep=strings("t3a")),
        Attempt(
            "T3-train",
            "traceback",
            [*TRAIN, *TINY, f"data.path={data512 / 't3b'}", "train.max_steps=1", f"run.dir={w / 't3b'}"],
            prep=strings("t3b"),
        ),
        Attempt(
            "W5-verify",
            "silently wrong",
            [*VERIFY, str(data512 / "w5a")],
            prep=docs_entry("w5a", 10**12),
            has=("docs.npy",),
        ),
        Attempt(
            "W5-train",
            "silently wrong",
            [
                *TRAIN,
                *TINY,
                f"data.path={data512 / 'w5b'}",
                "train.max_steps=2",
                "data.valid_fraction=0.1",
                "train.eval_interval=1",
                f"run.dir={w / 'w5b'}",
            ],
            prep=docs_entry("w5b", 10**12),
        ),
        Attempt(
            "W5-neg",
            "message",
            [*VERIFY, str(data512 / "w5c")],
            prep=docs_entry("w5c", -5),
            has=("docs.npy",),
        ),
        Attempt(
            "W6-missing",
            "silently wrong",
            [*IMPORT, str(w / "w6a"), str(w / "w6a-imp"), f"data.path={s.data}"],
            prep=hf_damage("w6a", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
            has=("model.layers.1.mlp.down_proj.weight",),
            check=lambda: "a step was written" if (w / "w6a-imp" / "step_00000000").exists() else None,
        ),
        Attempt(
            "W6-nan",
            "silently wrong",
            [*IMPORT, str(w / "w6b"), str(w / "w6b-imp"), f"data.path={s.data}"],
            prep=hf_damage("w6b", nan),
            has=("up_proj",),
        ),
        Attempt(
            "T4",
            "traceback",
            [*IMPORT, str(w / "t4"), str(w / "t4-imp"), f"data.path={s.data}"],
            prep=lambda: truncate(d.hf_copy("t4") / "model.safetensors"),
        ),
    ]


def writers_data_attempts(s: Setup) -> list[Attempt]:
    d = Data(s)
    return (
        lock_and_prepare_repros(s, d)
        + data_record_repros(s, d)
        + file_repros(s, d)
        + concurrent_writers(s, d)
        + data_identity(s, d)
        + checksums(s, d)
    )
