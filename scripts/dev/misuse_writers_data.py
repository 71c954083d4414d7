"""Attempts of scripts/dev/misuse_rerun.py on who writes a folder and what a run trained on: concurrent
writers (ids L*, CW*), the data a run records and a resume compares (W*, DI*), prepared-data and checkpoint
checksums (T3, W5, CS*), and the HF import's inputs (W6, T4). Ids L1-W8/T3/T4/K3 reproduce the documented
defects of these subjects with the fixed behaviour as the expected outcome; CW, DI and CS are further
attempts of the same classes."""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import load_file, save_file

from scripts.dev.misuse_base import GEN, RACE, TINY, TRAIN, Attempt, Setup, cfg, edit_meta, py, sh, stale_lock
from scripts.dev.misuse_datasets import (
    CKPT_VERIFY,
    PREPARE,
    VERIFY,
    Data,
    edit_json,
    first_shard,
    flip_byte,
    spec,
    truncate,
    verify_if_published,
)

EXPORT = py("scripts/export_hf.py")
IMPORT = py("scripts/import_hf.py")
EVAL = py("-m", "megaframe.evaluate")


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


def concurrent_writers(s: Setup, d: Data) -> list[Attempt]:
    """CW: writers started at one instant on one folder; exactly the expected number win, every loser is one
    line, and what the winners wrote verifies."""
    w = s.work
    a = lambda i, **k: Attempt(
        f"CW{i:02d}",
        "concurrent writers",
        [*RACE, "cmds", str(w / f"cw{i}.json")],
        # noqa: E731
        rc=0,
        timeout=600,
        **k,
    )
    syn = lambda run, *o: s.syn(run, "train.max_steps=2", "checkpoint.interval=2", *o)  # noqa: E731
    docs, tok = d.source, s.data / "tokenizer.model"

    def race(i, cmds, winners=1, then=(), before=None):
        def prep():
            for p in (
                w / f"cw{i}",
                w / f"cw{i}b",
                w / f"cw{i}c",
                w / "data" / f"cw{i}",
                w / "data" / f".cw{i}.partial",
            ):
                shutil.rmtree(p, ignore_errors=True)
            if before:
                before()
            spec(w / f"cw{i}.json", cmds(), winners, then)

        return a(i, prep=prep)

    ck = lambda i: w / f"cw{i}" / "ck"  # noqa: E731
    pdata = lambda i: w / "data" / f"cw{i}"  # noqa: E731
    prep_cmd = lambda i, *o: [
        *PREPARE,
        f"data.source={docs('docs')}",
        f"data.path={pdata(i)}",  # noqa: E731
        "data.num_workers=1",
        *o,
    ]
    out = [
        race(1, lambda: [syn("cw1"), syn("cw1")]),
        race(2, lambda: [syn("cw2b", f"checkpoint.dir={ck(2)}"), syn("cw2c", f"checkpoint.dir={ck(2)}")]),
        race(
            3,
            lambda: [syn("cw3", "train.seed=1"), syn("cw3", "train.seed=2"), syn("cw3", "train.seed=3")],
            before=lambda: stale_lock(w / "cw3"),
        ),
        race(
            4,
            lambda: [syn(f"cw4{x}", f"checkpoint.dir={ck(4)}") for x in "bc"],
            before=lambda: stale_lock(ck(4)),
        ),
        race(
            5,
            lambda: [
                prep_cmd(5, f"data.tokenizer={tok}", "data.num_tasks=2", "data.task=0"),
                prep_cmd(5, f"data.tokenizer={tok}", "data.num_tasks=3", "data.task=0"),
            ],
            None,
            then=[prep_cmd(5, f"data.tokenizer={tok}"), [*VERIFY, str(pdata(5))]],
        ),
        race(
            6,
            lambda: [prep_cmd(6, f"data.tokenizer={tok}"), prep_cmd(6, f"data.tokenizer={tok}")],
            None,
            then=[[*VERIFY, str(pdata(6))]],
        ),
        race(
            7,
            lambda: [prep_cmd(7, "data.vocab_size=512"), prep_cmd(7, "data.vocab_size=640")],
            None,
            then=[verify_if_published(pdata(7))],
        ),
        race(
            8,
            lambda: [
                [*EXPORT, str(s.ck), str(w / "cw8" / "hf")],
                [*EXPORT, str(s.ck), str(w / "cw8" / "hf")],
            ],
            then=[
                py(
                    "-c",
                    "import sys; from safetensors import safe_open; safe_open(sys.argv[1], 'pt')",
                    str(w / "cw8" / "hf" / "model.safetensors"),
                )
            ],
        ),
        race(
            9,
            lambda: [[*EXPORT, str(s.ck), str(w / "cw9" / "hf"), "--force"] for _ in range(2)],
            None,
            then=[
                py(
                    "-c",
                    "import sys; from safetensors import safe_open; safe_open(sys.argv[1], 'pt')",
                    str(w / "cw9" / "hf" / "model.safetensors"),
                )
            ],
        ),
        race(
            10,
            lambda: [[*IMPORT, str(d.hf()), str(ck(10)), f"data.path={s.data}"] for _ in range(2)],
            then=[[*CKPT_VERIFY, str(ck(10) / "step_00000000")]],
        ),
        race(
            11,
            lambda: [
                [*IMPORT, str(d.hf()), str(ck(11)), f"data.path={s.data}"],
                syn("cw11b", f"checkpoint.dir={ck(11)}"),
            ],
            None,
        ),
    ]
    live = s.p("cw12")
    out.append(
        Attempt(
            "CW12",
            "concurrent writers",
            [*IMPORT, str(w / "hf"), str(live / "checkpoints"), f"data.path={s.data}", "--force"],
            prep=lambda: (shutil.rmtree(live, ignore_errors=True), d.hf()),
            bg=s.syn("cw12", "train.max_steps=100000"),
            bg_wait=str(live / "checkpoints" / "megaframe.lock"),
            has=("in use",),
        )
    )
    return out


def data_identity(s: Setup, d: Data) -> list[Attempt]:
    """DI: a resume whose data differs from the recorded data is refused naming the key (or, allowed, warns);
    the same data under another spelling or in a moved copy resumes."""
    w = s.work
    a = lambda i, cmd, **k: Attempt(f"DI{i:02d}", "data identity", cmd, **k)  # noqa: E731
    base = lambda name, *o: s.run_tiny(name, "train.max_steps=7", *o)  # noqa: E731
    rb = lambda name: lambda: s.copy(name, "run")  # noqa: E731

    def link(name):
        def prep():
            s.copy(name, "run")
            if not (w / "demo-link").is_symlink():
                os.symlink(s.data, w / "demo-link")

        return prep

    def reprepared():
        tok = f"data.tokenizer={d.prepared('docs512') / 'tokenizer.model'}"
        redo = w / "data" / "redo"
        shutil.rmtree(redo, ignore_errors=True)
        shutil.rmtree(w / "di06", ignore_errors=True)
        sh([*PREPARE, f"data.source={d.source('docs')}", f"data.path={redo}", "data.num_workers=1", tok])
        d.trained("di06", f"data.path={redo}")
        shutil.rmtree(redo)
        sh([*PREPARE, f"data.source={d.source('scripts')}", f"data.path={redo}", "data.num_workers=1", tok])

    def swapped():
        s.copy("di12", "run")
        # the demo's data with another tokenizer's model file put in its place
        shutil.copy(d.prepared("docs512") / "tokenizer.model", d.copy("swaptok", s.data) / "tokenizer.model")

    blend3 = lambda *o: d.run("wd-blend", *o, steps=3)  # noqa: E731
    return [
        a(1, blend3(d.blend(("docs512", 1))), prep=d.blend_run, has=("data.blend",)),
        a(2, blend3(d.blend(("scr512", 0.5), ("docs512", 0.5))), prep=d.blend_run, has=("data.blend",)),
        a(
            3,
            d.run(
                "wd-stages",
                d.stages(extra=f"{{until_step: 5, blend: [{{path: {d.at('scr512')}}}]}}, "),
                steps=4,
            ),
            prep=d.stages_run,
            has=("data.stages",),
        ),
        a(
            4,
            d.run("wd-stages", d.blend(("docs512", 0.5), ("scr512", 0.5)), steps=4),
            prep=d.stages_run,
            has=("data.stages",),
        ),
        a(
            5,
            base("di05", "data.valid_fraction=0.05", "checkpoint.allow_config_change=[data.valid_fraction]"),
            rc=0,
            prep=rb("di05"),
            has=("resuming with data.valid_fraction changed", "resumed from"),
        ),
        a(
            6,
            d.run("di06", f"data.path={w / 'data' / 'redo'}", steps=3),
            prep=reprepared,
            has=("prepared again",),
        ),
        a(
            7,
            base("di07", f"data.path={s.data}/"),
            rc=0,
            prep=rb("di07"),
            has=("resumed from",),
            lacks=("warning: resuming with",),
        ),
        a(
            8,
            base("di08", f"data.path={w / 'demo-link'}"),
            rc=0,
            prep=link("di08"),
            has=("resumed from",),
            lacks=("warning: resuming with",),
        ),
        a(
            9,
            base("di09", f"data.path={s.data.parent}/../demo/prepared"),
            rc=0,
            prep=rb("di09"),
            has=("resumed from",),
            lacks=("warning: resuming with",),
        ),
        a(
            10,
            base("di10", f"data.path={w / 'data' / 'democopy'}"),
            rc=0,
            prep=lambda: (s.copy("di10", "run"), d.copy("democopy", s.data)),
            has=("resumed from",),
        ),
        a(
            11,
            base("di11", f"data.path={d.at('docsdemo')}"),
            prep=lambda: (d.ready(), s.copy("di11", "run")),
            has=("data.path",),
        ),
        a(12, base("di12", f"data.path={w / 'data' / 'swaptok'}"), prep=swapped),
        a(13, base("di13", "data=synthetic"), prep=rb("di13"), has=("data.kind",)),
        a(14, base("di14", "train.seed=5"), prep=rb("di14"), has=("train.seed",)),
    ]


def checksums(s: Setup, d: Data) -> list[Attempt]:
    """CS: one flipped byte or a cut file in prepared data, a checkpoint or an HF folder is refused in one
    line by the tool that reads it (or, for resume=auto, passed over to the parent checkpoint)."""
    w = s.work
    a = lambda i, cmd, **k: Attempt(f"CS{i:02d}", "checksums", cmd, **k)  # noqa: E731
    dd = lambda name: w / "data" / name  # noqa: E731
    train = lambda name: [
        *TRAIN,
        *TINY,
        f"data.path={dd(name)}",
        "train.max_steps=1",  # noqa: E731
        f"run.dir={w / name}",
        "data.valid_fraction=0.1",
        "train.eval_interval=1",
    ]

    def damaged(name, fn, key="file", of="docs512"):
        return lambda: fn(first_shard(d.copy(name, of), key))

    def meta_digit(name):
        def prep():
            def bump(m):
                h = m["shards"][0]["sha256"]
                m["shards"][0]["sha256"] = ("1" if h[0] == "0" else "0") + h[1:]

            edit_json(d.copy(name, "docs512") / "meta.json", bump)

        return prep

    def ck_damage(name, fn):
        def prep():
            c = s.copy(name, "run")
            fn(next((c / "step_00000006").glob("*.safetensors")))

        return prep

    head = lambda name: s.p(name) / "checkpoints" / "step_00000006"  # noqa: E731

    def meta_crc(name):
        """The recorded header checksum of the head's shard off by one (still valid JSON)."""

        def prep():
            c = s.copy(name, "run")
            edit_meta(
                c / "step_00000006",
                lambda m: next(iter(m["files"].values())).update(
                    header_crc32=next(iter(m["files"].values()))["header_crc32"] ^ 1
                ),
            )

        return prep

    return [
        a(1, [*VERIFY, str(dd("cs01"))], prep=damaged("cs01", flip_byte), has=("sha256",)),
        a(2, [*VERIFY, str(dd("cs02"))], prep=damaged("cs02", lambda f: flip_byte(f, 0.9), "docs")),
        a(3, train("cs03"), prep=damaged("cs03", lambda f: flip_byte(f, 0.9), "docs")),
        a(4, [*VERIFY, str(dd("cs04"))], prep=meta_digit("cs04")),
        a(5, [*VERIFY, str(dd("cs05"))], prep=lambda: truncate(d.copy("cs05", "docs512") / "meta.json")),
        a(6, train("cs06"), prep=lambda: truncate(d.copy("cs06", "docs512") / "meta.json")),
        a(7, train("cs07"), prep=damaged("cs07", truncate)),
        a(8, train("cs08"), prep=damaged("cs08", lambda f: truncate(f, 0.7), "docs")),
        a(9, train("cs09"), prep=lambda: truncate(d.copy("cs09", "docs512") / "tokenizer.model")),
        # in the model's weights (the first 14 % of the shard): generate reads no optimizer state, whose
        # bytes it rightly does not check
        a(
            10,
            [*GEN, str(head("cs10")), "--prompt", "The", "--max-new-tokens", "2"],
            prep=ck_damage("cs10", lambda f: flip_byte(f, 0.05)),
        ),
        a(11, [*EXPORT, str(head("cs11")), str(w / "cs11-hf")], prep=ck_damage("cs11", flip_byte)),
        a(12, [*CKPT_VERIFY, str(head("cs12"))], prep=meta_crc("cs12")),
        a(
            13,
            s.run_tiny("cs13", "train.max_steps=7"),
            rc=0,
            prep=meta_crc("cs13"),
            has=("skipping checkpoint", "step_00000003"),
        ),
        # the head's metadata unreadable in a folder of two branches: refused, naming both (a single branch
        # would be used with a warning)
        a(
            14,
            s.run_tiny("cs14", "train.max_steps=7"),
            prep=lambda: truncate(s.copy("cs14", "run") / "step_00000006" / "metadata.json"),
            has=("branches",),
        ),
        a(
            15,
            [*IMPORT, str(w / "cs15"), str(w / "cs15-imp"), f"data.path={s.data}"],
            prep=lambda: truncate(d.hf_copy("cs15") / "config.json"),
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
