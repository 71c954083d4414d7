"""The first attempt lists of scripts/dev/misuse_rerun.py: lost work and shared folders (ids S*, L*), config
checks (K*) and refused field values (C2-*). The set-up they share (misuse_base.Setup) is a run that saved
2,4,6,8 and a rollback from 2 that saved 3 and 6 (the abandoned branch's 6 kept aside)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from scripts.dev.misuse_base import (
    GEN,
    META_FORMS,
    PLAN,
    ROOT,
    TINY,
    TRAIN,
    Attempt,
    Setup,
    cfg,
    py,
    sh,
    write,
)


def note_attempts(s: Setup) -> list[Attempt]:
    """Section 1 of the note, one attempt per reproduction command (T1: each form x each tool)."""
    ck, w = s.ck, s.work
    out: list[Attempt] = []
    (w / "emptydir").mkdir(exist_ok=True)
    had_root = Path("/checkpoints").exists()
    out.append(
        Attempt(
            "S1",
            "security",
            [*TRAIN, "data=synthetic", "train.max_steps=1", "checkpoint.resume=none", "run.dir="],
            has=("run.dir='' must not be empty",),
            cwd=w / "emptydir",
            check=lambda: (
                "wrote outside"
                if list((w / "emptydir").iterdir()) or (Path("/checkpoints").exists() and not had_root)
                else None
            ),
        )
    )
    shared = s.p("shared_ck")
    out.append(
        Attempt(
            "L1",
            "lost work",
            s.syn("scb", "train.seed=2", "train.max_steps=2", f"checkpoint.dir={shared}"),
            bg=s.syn("sca", "train.seed=1", "train.max_steps=100000", f"checkpoint.dir={shared}"),
            bg_wait=str(shared / "megaframe.lock"),
            has=(f"checkpoint.dir={shared} is in use by another run",),
        )
    )
    sh2 = s.p("shared2")
    out.append(
        Attempt(
            "L1-seq",
            "lost work",
            s.syn(
                "r2b",
                "train.seed=22",
                "train.max_steps=6",
                "checkpoint.interval=3",
                "checkpoint.resume=none",
                f"checkpoint.dir={sh2}",
            ),
            prep=lambda: sh(
                s.syn(
                    "r2a",
                    "train.seed=11",
                    "train.max_steps=6",
                    "checkpoint.interval=3",
                    f"checkpoint.dir={sh2}",
                )
            ),
            has=("step_00000006 belongs to another run",),
            check=lambda: (
                None
                if (sh2 / "latest").read_text().strip() == "step_00000006"
                and "r2a"
                in json.loads((sh2 / "step_00000003" / "metadata.json").read_text())["lineage"]["run_dir"]
                else "the first run's checkpoints changed"
            ),
        )
    )
    out.append(
        Attempt(
            "L2",
            "lost work",
            s.syn("r3", "train.max_steps=4"),
            env={"SLURM_JOB_ID": "778"},
            bg=s.syn("r3", "train.max_steps=100000"),
            bg_wait=str(s.p("r3") / "megaframe.lock"),
            has=("is in use by another run",),
        )
    )
    l3 = w / "l3" / "step_00000006"
    out.append(
        Attempt(
            "L3",
            "lost work",
            py("scripts/export_hf.py", str(l3), str(l3), "--force"),
            prep=lambda: s.copy("l3"),
            has=("overlaps the checkpoint it exports",),
            check=lambda: None if (l3 / "metadata.json").is_file() else "the checkpoint is gone",
        )
    )
    for tool, cmd in [
        ("generate", [*GEN, str(ck), "--prompt", "The", "--max-new-tokens", "2"]),
        ("evaluate", py("-m", "megaframe.evaluate", str(ck), "train.eval_iters=1")),
        ("export_hf", py("scripts/export_hf.py", str(ck), str(w / "hf_w1"), "--force")),
    ]:
        out.append(
            Attempt(
                f"W1-{tool[:3]}",
                "silently wrong",
                cmd,
                rc=0,
                has=(str(ck / "step_00000006"),),
                lacks=("step_00000008",),
            )
        )
    for name, damage in [
        ("garbage", lambda c: write(c / "latest", "garbage\n")),
        ("deleted", lambda c: (c / "latest").unlink()),
        ("head-meta", lambda c: write(c / "step_00000006" / "metadata.json", "{}")),
    ]:
        out.append(
            Attempt(
                f"W2-{name[:4]}",
                "silently wrong",
                s.run_tiny(f"w2{name}", f"checkpoint.dir={w / ('w2' + name + 'ck')}", "train.max_steps=10"),
                prep=lambda n=name, d=damage: d(s.copy(f"w2{n}ck")),
                has=("branches",),
            )
        )
    out.append(
        Attempt(
            "C1",
            "crash mid-run",
            [
                *TRAIN,
                *TINY,
                "parallel.cp=2",
                "train.sample_interval=2",
                "train.sample_tokens=4",
                "train.max_steps=2",
                f"run.dir={w / 'cp8b'}",
            ],
            env={"WORLD_SIZE": "2"},
            has=("train.sample_interval=2 is not built with parallel.cp=2",),
        )
    )
    for form, text in META_FORMS.items():
        c = w / f"t1{form}"
        prep = lambda c=c, t=text: (
            c.exists() or (s.copy(c.name), write(c / "step_00000006" / "metadata.json", t))
        )
        step = str(c / "step_00000006")
        out += [
            Attempt(
                f"T1-{form[:5]}-auto",
                "traceback",
                s.run_tiny(f"t1r{form}", f"checkpoint.dir={c}", "train.max_steps=10"),
                prep=prep,
            ),
            Attempt(
                f"T1-{form[:5]}-res",
                "traceback",
                s.run_tiny(f"t1e{form}", f"checkpoint.resume={step}"),
                prep=prep,
            ),
            Attempt(
                f"T1-{form[:5]}-gen",
                "traceback",
                [*GEN, step, "--prompt", "The"],
                prep=prep,
                lacks=("no tokenizer found",),
            ),  # K9 too
            Attempt(
                f"T1-{form[:5]}-ver", "traceback", py("-m", "megaframe.checkpoint", "verify", step), prep=prep
            ),
        ]
    for i, (over, rc, has) in enumerate(
        [
            cfg("optim.min_lr=1", "optim.lr=1e-3", rc=2, has=("optim.min_lr=1",)),
            cfg("optim.lr_decay_steps=1", "optim.warmup_steps=10", rc=2, has=("optim.lr_decay_steps=1",)),
            cfg(
                f"data.blend=[{{path: {s.data}, weight: inf}}, {{path: {s.data}, weight: 1}}]",
                rc=2,
                has=("must be finite",),
                synthetic=False,
            ),
            cfg(
                f"data.blend=[{{path: {s.data}, weight: 1e308}}, {{path: {s.data}, weight: 1e308}}]",
                rc=2,
                has=("sum to infinity",),
                synthetic=False,
            ),
        ]
    ):
        out.append(Attempt(["W3-a", "W3-b", "W4-a", "W4-b"][i], "silently wrong", over, rc=rc, has=has))
    out.append(
        Attempt(
            "T2",
            "traceback",
            s.syn("t2", "train.max_steps=6", "checkpoint.interval=3", "checkpoint.dir=/proc/megaframe-rt/ck"),
            has=("cannot write there",),
        )
    )
    for i, prompt in enumerate([b"\xff\xfeab", b"caf\xe9"]):
        out.append(
            Attempt(f"T3-{'ab'[i]}", "traceback", [*GEN, str(ck), "--prompt", prompt], has=("not UTF-8",))
        )
    out.append(Attempt("T3-nan", "traceback", [*GEN, str(ck), "--prompt", "The", "--temperature", "nan"]))
    for i, extra in enumerate(
        [
            ["+world_size=4", "+device_memory_gb=nan"],
            ["+world_size=2", "+device_memory_gb=inf"],
            ["+world_size=4", "+search=true", "+efficiency=0", "+device=H100"],
            ["+world_size=4", f"+plan_json={w / 'nodir' / 'x.json'}"],
            ["+world_size=4", f"+plan_json={w}"],
        ]
    ):
        out.append(Attempt(f"T4-{'abcde'[i]}", "traceback", [*PLAN, *extra]))
    out.append(
        Attempt(
            "T5",
            "traceback",
            py("-m", "megaframe.plot", str(s.rb), "--out", str(w / "nodir" / "x.png")),
            has=("--out",),
        )
    )
    for i, f in enumerate([s.data / "meta.json", ROOT / "README.md"]):
        out.append(Attempt(f"T6-{'ab'[i]}", "traceback", py("-m", "megaframe.data", "verify", str(f))))
    for i, over in enumerate(["train.dist_timeout_s=1e30", "checkpoint.save_timeout_s=1e14"]):
        out.append(Attempt(f"T7-{'ab'[i]}", "traceback", *cfg(over, rc=2)[:2]))
    trav = w / "trav"

    def make_trav():
        shutil.rmtree(trav, ignore_errors=True)
        shutil.copytree(s.data, trav)
        _edit_meta_json(trav, lambda m: m["shards"][0].update(file="../../../../etc/hostname"))

    out.append(
        Attempt(
            "S2",
            "security",
            py("-m", "megaframe.data", "verify", str(trav)),
            prep=make_trav,
            has=("not a plain name",),
            lacks=("sha256",),
        )
    )
    out.append(
        Attempt(
            "F6",
            "lost work",
            py("-m", "megaframe.checkpoint", "verify", str(ck / "step_00000006")),
            rc=0,
            check=lambda: None if list(ck.glob("step_00000006.replaced-*")) else "the old step 6 is gone",
        )
    )
    out += k_attempts(s)
    return out


def _edit_meta_json(folder: Path, fn) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    fn(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def k_attempts(s: Setup) -> list[Attempt]:
    ck, w = s.ck, s.work
    out = [
        Attempt(
            "K1",
            "cosmetic",
            *cfg(
                "model=gpt_tiny",
                *TINY,
                f"data.path={s.data}",
                f"checkpoint.resume={ck / 'step_00000006'}",
                rc=0,
                synthetic=False,
            )[:2],
        ),
        Attempt("K2", "cosmetic", *cfg("optim.lr_schedule=wsd", "optim.wsd_decay_fraction=1.0", rc=0)[:2]),
    ]
    for i, extra in enumerate(
        ["+device_memory_gb=0", "+device_memory_gb=-1", "+top=0", "+efficiency=50", "+search=maybe"]
    ):
        out.append(Attempt(f"K3-{'abcde'[i]}", "cosmetic", [*PLAN, "+world_size=4", extra]))
    out.append(Attempt("K3-f", "cosmetic", [*PLAN, "+world_size=0"]))
    for kid, over in [
        ("K4", "checkpoint.allow_config_change=[foo.bar]"),
        ("K5", "optim.overlap_param_gather=2"),
        ("K6", "train.hang_timeout_s=1e-9"),
    ]:
        out.append(Attempt(kid, "cosmetic", *cfg(over, rc=2)[:2]))
    bad = w / "k7" / "prompts.txt"
    out.append(
        Attempt(
            "K7-gen",
            "cosmetic",
            [*GEN, str(ck), "--prompts", str(bad)],
            has=(str(bad),),
            prep=lambda: write(bad, b"ok\n\xff\xfe\n"),
        )
    )
    out.append(
        Attempt(
            "K7-plot",
            "cosmetic",
            py("-m", "megaframe.plot", str(w / "k7plot")),
            has=("metrics.jsonl",),
            prep=lambda: write(w / "k7plot" / "metrics.jsonl", bytes(range(256)) * 4),
        )
    )
    out.append(
        Attempt(
            "K8",
            "cosmetic",
            *cfg(
                "data.path=/nonexistent",
                f"data.blend=[{{path: {s.data}}}]",
                rc=2,
                has=("are both set",),
                synthetic=False,
            ),
        )
    )
    prompts = w / "k10" / "prompts.txt"
    out.append(
        Attempt(
            "K10",
            "cosmetic",
            [*GEN, str(ck), "--prompts", str(prompts), "--max-new-tokens", "2"],
            has=("prompt 2 of 3 has",),
            prep=lambda: write(prompts, "The\n" + "word " * 100 + "\nOnce\n"),
        )
    )
    return out


def section2(s: Setup) -> list[Attempt]:
    """Section 2's config cases that were held: still a clean exit 0 or a one-line exit 2."""
    cases = [
        "optim.zero=4",
        "optim.zero=1.5",
        "optim.zero=true",
        "optim.shard_group_size=-1",
        "optim.shard_group_size=3",
        "parallel.cp=0",
        "parallel.cp=3",
        "parallel.cp_comm=foo",
        "parallel.cp_comm=null",
        "optim.lr_schedule=exp",
        "optim.lr_decay_steps=0",
        "optim.lr_decay_steps=1.5",
        "optim.wsd_decay_fraction=0",
        "optim.wsd_decay_fraction=nan",
        "train.signal_check_interval=0",
        "train.signal_check_interval=1e12",
        "train.hang_timeout_s=1e30",
        "checkpoint.save_timeout_s=inf",
        "train.sample_prompts=[]",
        "train.sample_tokens=100000",
        "train.sample_prompts=['']",
        "train.sample_prompts=[null]",
        "optim.bucket_size_mb=1e-9",
        "optim.bucket_size_mb=1e30",
        "checkpoint.allow_config_change=notalist",
        "checkpoint.on_save_error=maybe",
        "train.seed=9223372036854775807",
        "model.seq_length=1",
        "checkpoint.resume=''",
        "optim.warmup_steps=1e20",
        "train.max_steps=1e20",
        "train.dist_timeout_s=1e-9",
    ]
    out = [
        Attempt(f"C2-{i:02d}", "field range", *cfg(c, "train.sample_interval=1")[:2])
        for i, c in enumerate(cases)
    ]
    out.append(
        Attempt(f"C2-{len(cases):02d}", "field range", *cfg("model=moe_tiny", "model.moe_top_k=9")[:2])
    )
    return out
