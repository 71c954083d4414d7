"""Attempts of scripts/dev/misuse_rerun.py (through misuse_writers_data.py) on concurrent writers started at
one instant (CW*), the data identity a resume compares (DI*) and prepared-data and checkpoint checksums
(CS*): further attempts of the classes misuse_writers_data.py reproduces."""

from __future__ import annotations

import os
import shutil

from scripts.dev.misuse_base import GEN, RACE, TINY, TRAIN, Attempt, Setup, edit_meta, py, sh, stale_lock
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
