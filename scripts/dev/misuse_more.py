"""More attempts for scripts/dev/misuse_rerun.py: NS shared folders, NL lineage corruption, NT tool inputs,
NF field ranges."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from scripts.dev.misuse_base import (
    GEN,
    PLAN,
    TINY,
    TRAIN,
    Attempt,
    Setup,
    cfg,
    edit_meta,
    py,
    sh,
    stale_lock,
    write,
)


def shared_folders(s: Setup) -> list[Attempt]:
    w, sh2 = s.work, s.p("shared2")  # run r2a's checkpoints (seed 11), written by attempt L1-seq
    a = lambda i, cmd, **k: Attempt(f"NS{i:02d}", "shared folders", cmd, **k)  # noqa: E731
    seed = "train.seed=11"
    first = lambda: (
        (sh2 / "latest").is_file()
        or sh(
            s.syn(
                "r2a",
                seed,
                "train.max_steps=6",  # noqa: E731
                "checkpoint.interval=3",
                f"checkpoint.dir={sh2}",
            )
        )
    )
    return [
        a(
            1,
            s.syn("ns1", seed, "train.max_steps=8", f"checkpoint.dir={sh2}"),
            prep=first,
            has=("belongs to another run",),
        ),
        a(
            2,
            s.syn(
                "ns2",
                seed,
                "train.max_steps=8",
                f"checkpoint.dir={sh2}",
                f"checkpoint.resume={s.ck / 'step_00000003'}",
            ),
            prep=first,
            has=("is not one of its checkpoints",),
        ),
        a(
            3,
            s.syn("ns3", seed, "train.max_steps=7", f"checkpoint.dir={sh2}", f"checkpoint.resume={sh2}"),
            rc=0,
            prep=first,
            has=(f"resumed from {sh2 / 'step_00000006'} at step 6",),
        ),
        a(
            4,
            s.syn("r2a", seed, "train.max_steps=8", f"checkpoint.dir={sh2}"),
            has=("step_00000007 belongs to another run", str(s.p("ns3"))),
        ),
        a(
            5,
            s.syn(
                "ns3",
                seed,
                "train.max_steps=9",
                "checkpoint.interval=1",
                "checkpoint.keep_last=1",
                f"checkpoint.dir={sh2}",
            ),
            rc=0,
            check=lambda: (
                None
                if (sh2 / "step_00000003").is_dir()
                and (sh2 / "step_00000006").is_dir()
                and not (sh2 / "step_00000007").exists()
                else "keep_last deleted another run's checkpoint (or none)"
            ),
        ),
        a(
            6,
            s.run_tiny("rbcopy", "train.max_steps=7"),
            prep=lambda: s.copy("rbcopy", "run"),
            rc=0,
            has=(f"resumed from {s.p('rbcopy') / 'checkpoints' / 'step_00000006'}",),
        ),
        a(
            7,
            s.run_tiny("rbnoid", "train.max_steps=7"),
            rc=0,
            has=("resumed from",),
            prep=lambda: (s.copy("rbnoid", "run"), (s.p("rbnoid") / "megaframe.run_id").unlink()),
        ),
        a(
            8,
            s.run_tiny("rbgarb", "train.max_steps=7"),
            rc=0,
            has=("resumed from",),
            prep=lambda: (
                s.copy("rbgarb", "run"),
                write(s.p("rbgarb") / "megaframe.run_id", b"\xff\x00junk"),
            ),
        ),
        a(
            9,
            s.syn("ns9", seed, "train.max_steps=8", f"checkpoint.dir={w / 'nslink'}"),
            prep=lambda: (w / "nslink").is_symlink() or os.symlink(sh2, w / "nslink"),
            has=("belongs to another run",),
        ),
        a(
            10,
            s.syn("ns10", "train.max_steps=4", f"checkpoint.dir={w / 'ns10ck'}"),
            bg=s.syn("ns10", "train.max_steps=100000"),
            bg_wait=str(s.p("ns10") / "megaframe.lock"),
            has=(f"run.dir={s.p('ns10')} is in use by another run",),
        ),
        a(
            11,
            s.syn("ns11", "train.max_steps=2", f"checkpoint.dir={w / 'ns11'}"),
            rc=0,
            check=lambda: (
                None if (w / "ns11" / "step_00000002" / "metadata.json").is_file() else "no checkpoint"
            ),
        ),
        a(12, [*TRAIN, "data=synthetic", "run.dir=   ", "train.max_steps=1"], has=("must not be empty",)),
        a(
            13,
            s.syn("ns13", f"checkpoint.dir={w / 'afile'}"),
            prep=lambda: write(w / "afile", "x"),
            has=("is a file, not a folder",),
        ),
        a(
            14,
            [*TRAIN, *TINY, "data=synthetic", "run.dir=/proc/megaframe-rt/run", "train.max_steps=1"],
            has=("cannot write there",),
        ),
        a(
            15,
            s.syn("ns15", "train.max_steps=1", f"checkpoint.dir={w / 'ns15ck'}"),
            rc=0,
            prep=lambda: stale_lock(w / "ns15ck"),
        ),
    ]


def lineage_corruption(s: Setup) -> list[Attempt]:
    def case(i, name, damage, rc=2, has=(), tool="train"):
        """A copy of the rollback's whole run folder (the same run: resume=auto may continue it), damaged."""

        def prep():
            damage(s.copy(name, "run"))

        ck = s.p(name) / "checkpoints"
        cmd = {
            "train": s.run_tiny(name, "train.max_steps=7"),
            "export": py("scripts/export_hf.py", str(ck), str(s.p(name + "-hf")), "--force"),
            "generate": [*GEN, str(ck), "--prompt", "The", "--max-new-tokens", "2"],
        }[tool]
        return Attempt(f"NL{i:02d}", "lineage", cmd, rc=rc, has=has, prep=prep)

    six = "step_00000006"
    return [
        case(1, "nl1", lambda c: write(c / "latest", "../x/step_00000009\n"), has=("branches",)),
        case(
            2,
            "nl2",
            lambda c: write(c / "latest", "step_00000008\n"),
            rc=0,
            has=("resumed from", "step_00000008"),
        ),
        case(3, "nl3", lambda c: ((c / "latest").unlink(), (c / "latest").mkdir()), has=("branches",)),
        case(4, "nl4", lambda c: edit_meta(c / six, lambda m: m.update(lineage="x")), rc=(0, 2)),
        case(5, "nl5", lambda c: edit_meta(c / six, lambda m: m["lineage"].update(parent=5)), rc=(0, 2)),
        case(
            6,
            "nl6",
            lambda c: edit_meta(c / six, lambda m: m["lineage"].update(parent="/etc")),
            rc=0,
            has=("resumed from",),
        ),
        case(
            7,
            "nl7",
            lambda c: edit_meta(
                c / six, lambda m: m["lineage"].update(parent=six, parent_id=m["lineage"]["id"])
            ),
            rc=0,
            has=("resumed from",),
        ),
        case(8, "nl8", lambda c: edit_meta(c / six, lambda m: m.update(step="6")), rc=(0, 2)),
        case(9, "nl9", lambda c: edit_meta(c / six, lambda m: m.update(step=999)), has=("step",)),
        case(10, "nl10", lambda c: write(c / "latest", bytes(range(256))), has=("branches",)),
        case(11, "nl11", lambda c: write(c / "latest", "garbage\n"), has=("branches",), tool="export"),
        case(12, "nl12", lambda c: write(c / "latest", "garbage\n"), has=("branches",), tool="generate"),
        case(
            13,
            "nl13",
            lambda c: _truncate(next((c / six).glob("*.safetensors"))),
            rc=0,
            has=("skipping checkpoint", "resumed from", "step_00000003"),
        ),
    ]


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def tool_inputs(s: Setup) -> list[Attempt]:
    ck, w = s.ck, s.work
    a = lambda i, cmd, **k: Attempt(f"NT{i:02d}", "tool inputs", cmd, **k)  # noqa: E731
    ev = py("-m", "megaframe.evaluate")
    link = w / "ntlink"

    def make_link():
        shutil.rmtree(link, ignore_errors=True)
        shutil.copytree(s.data, link)
        first = json.loads((link / "meta.json").read_text())["shards"][0]["file"]
        (link / first).unlink()
        os.symlink("/etc/hostname", link / first)  # a link out of the data folder

    return [
        a(1, [*GEN, str(ck), "--prompt", "The", "--max-new-tokens", "-1"]),
        a(2, [*GEN, str(ck), "--prompt", "The", "--top-p", "1.5"]),
        a(3, [*GEN, str(ck), "--prompts", str(w / "missing.txt")], has=("--prompts",)),
        a(4, ev),
        a(5, [*ev, str(ck), "train.eval_iters=-1"]),
        a(6, py("-m", "megaframe.plot", str(w / "emptydir"))),
        a(7, py("scripts/export_hf.py", str(ck), str(ck / "hf")), has=("overlaps",)),
        a(8, py("scripts/import_hf.py", str(w / "no-hf-here"), str(w / "imported"))),
        a(9, py("-m", "megaframe.checkpoint", "verify", str(w / "no-ckpt-here"))),
        a(10, py("-m", "megaframe.data", "verify", str(link)), prep=make_link, lacks=("sha256",)),
        a(11, [*PLAN, "+world_size=abc"]),
        a(12, [*GEN, str(ck), "--prompt", "The", "--temperature", "-1"]),
        a(13, [*GEN, str(ck), "--prompt", "The", "--seed", "abc"]),
        a(14, [*ev, str(ck), "data.path=/nonexistent"]),
        a(15, py("scripts/export_hf.py", str(ck), str(w / "nt15"), "--dtype", "fp7")),
    ]


def field_ranges(s: Setup) -> list[Attempt]:
    d = s.data
    cases = [
        "train.micro_batch_size=0",
        "model.dropout=1.0",
        "optim.beta2=1.0",
        "optim.clip_grad=-1",
        "checkpoint.keep_last=-1",
        "data.valid_fraction=1.0",
        "train.eval_iters=0",
        "model.num_query_groups=3",
        "parallel.tp_comm_chunks=0",
        "checkpoint.interval_minutes=nan",
        "model.rope_theta=inf",
        "train.compile=2",
        "data.document_mask=yes",
        "optim.lr=nan",
        "train.seed=-1",
        "parallel.tp_comm_overlap=on",
    ]
    out = [Attempt(f"NF{i + 1:02d}", "field ranges", *cfg(c, rc=2)[:2]) for i, c in enumerate(cases)]
    stages = (
        f"data.stages=[{{until_step: 5, blend: [{{path: {d}}}]}}, {{until_step: 3, blend: [{{path: {d}}}]}}, "
        f"{{blend: [{{path: {d}}}]}}]"
    )
    out.append(
        Attempt("NF17", "field ranges", *cfg(stages, rc=2, has=("ends at or before",), synthetic=False))
    )
    out.append(
        Attempt("NF18", "field ranges", *cfg("model=moe_tiny", "model.moe_capacity_factor=0", rc=2)[:2])
    )
    return out


def new_attempts(s: Setup) -> list[Attempt]:
    return shared_folders(s) + lineage_corruption(s) + tool_inputs(s) + field_ranges(s)
