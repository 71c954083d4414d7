"""Attempts of scripts/dev/misuse_rerun.py on a full disk (real size-limited tmpfs mounts and `ulimit -f`; ids
C1, C2, DF*), pipeline schedules and layouts (C3, C4, SV*), the planner (H1, T6) and damaged checkpoint
fields (T2, T5, K1, K2; T1 the stage ends). Ids C1-K2 reproduce the documented defects of these subjects with
the fixed behaviour as the expected outcome; DF and SV are further attempts of the same classes."""

from __future__ import annotations

import shutil

from scripts.dev.misuse_base import (
    PLAN,
    TINY,
    TORCHRUN2,
    TRAIN,
    Attempt,
    Setup,
    cfg,
    edit_meta,
    fsize_limited,
    mount_tmpfs,
    py,
    sh,
    umount,
)
from scripts.dev.misuse_datasets import CKPT_VERIFY, PREPARE, Data

EXPORT = py("scripts/export_hf.py")
IMPORT = py("scripts/import_hf.py")
TINY4 = [("model.num_layers=4" if t.startswith("model.num_layers=") else t) for t in TINY]
ZBV = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv"]
MOE_FULL = ["model=moe_tiny", "train.global_batch_size=12", "train.recompute=full"]
SAVE = ["train.max_steps=3", "checkpoint.interval=1", "checkpoint.resume=none"]


def _ckpt_bytes(s: Setup) -> int:
    """One checkpoint of the synthetic tiny model, measured (a tmpfs is sized from it)."""
    probe = s.p("size-probe") / "ck"
    if not (probe / "latest").is_file():
        shutil.rmtree(probe.parent, ignore_errors=True)
        sh(s.syn("size-probe", "train.max_steps=1", "checkpoint.interval=1"))
        shutil.move(str(s.p("size-probe") / "checkpoints"), str(probe))
    return sum(f.stat().st_size for f in (probe / "step_00000001").rglob("*") if f.is_file())


def _not_committed(ck, latest: str | None):
    def check():
        if list(ck.glob("*.tmp")):
            return f"left behind: {[p.name for p in ck.glob('*.tmp')]}"
        now = (ck / "latest").read_text().strip() if (ck / "latest").is_file() else None
        return None if now == latest else f"latest is {now}, expected {latest}"

    return check


def disk_repros(s: Setup) -> list[Attempt]:
    """C1 (a save on a full file system or past the file-size limit), C2 (a full run.dir)."""
    w = s.work
    mnt = lambda name: w / "mnt" / name  # noqa: E731
    kib = lambda: _ckpt_bytes(s) * 3 // 2 // 1024  # noqa: E731  one checkpoint fits, two do not
    full_ck = lambda name: lambda: mount_tmpfs(mnt(name), f"{kib()}k")  # noqa: E731
    return [
        Attempt(
            "C1-tmpfs",
            "crash mid-run",
            s.syn("c1a", *SAVE, "checkpoint.keep_last=0", f"checkpoint.dir={mnt('c1a') / 'ck'}"),
            rc=1,
            prep=full_ck("c1a"),
            has=("checkpoint step 2 not committed", "No space left"),
            check=_not_committed(mnt("c1a") / "ck", "step_00000001"),
            after=lambda: umount(mnt("c1a")),
        ),
        Attempt(
            "C1-fsize",
            "crash mid-run",
            fsize_limited(s.syn("c1b", *SAVE, f"checkpoint.dir={w / 'c1b-ck'}"), _ckpt_bytes(s) // 2048),
            rc=1,
            prep=lambda: shutil.rmtree(w / "c1b-ck", ignore_errors=True),
            has=("checkpoint step 1 not committed", "File too large"),
            check=_not_committed(w / "c1b-ck", None),
        ),
        Attempt(
            "C1-2ranks",
            "crash mid-run",
            [
                *TORCHRUN2,
                *TINY,
                "data=synthetic",
                *SAVE,
                f"run.dir={w / 'c1c'}",
                "checkpoint.on_save_error=continue",
                "checkpoint.keep_last=0",
                f"checkpoint.dir={mnt('c1c') / 'ck'}",
            ],
            rc=0,
            timeout=400,
            prep=full_ck("c1c"),
            has=("checkpoint step 2 not committed", "step      3/3"),
            check=_not_committed(mnt("c1c") / "ck", "step_00000001"),
            after=lambda: umount(mnt("c1c")),
        ),
        Attempt(
            "C2",
            "crash mid-run",
            s.syn(
                "c2",
                "train.max_steps=20",
                "checkpoint.interval=0",
                "checkpoint.resume=none",
                f"run.dir={mnt('c2') / 'run'}",
                f"checkpoint.dir={w / 'c2-ck'}",
            ),
            rc=0,
            prep=lambda: (
                shutil.rmtree(w / "c2-ck", ignore_errors=True),
                mount_tmpfs(mnt("c2"), "64k", fill=48 << 10),
            ),
            has=("No space left", "step     20/20"),
            check=lambda: None if (w / "c2-ck" / "step_00000020").is_dir() else "no step 20 checkpoint",
            after=lambda: umount(mnt("c2")),
        ),
    ]


def schedule_repros(s: Setup) -> list[Attempt]:
    """C3, C4 (zero-bubble layouts), H1 and T6 (the planner), T1 (stage ends)."""
    w, d = s.work, s.data
    two = {"WORLD_SIZE": "2"}
    stage = lambda end: (
        f"data.stages=[{{until_tokens: {end}, blend: [{{path: {d}}}]}}, "  # noqa: E731
        f"{{blend: [{{path: {d}}}]}}]"
    )
    return [
        Attempt(
            "C3",
            "crash mid-run",
            [
                *TORCHRUN2,
                *TINY4,
                "data=synthetic",
                "train.max_steps=2",
                *ZBV,
                "parallel.pp_layout=[2,0,1,1]",
                f"run.dir={w / 'c3'}",
                "checkpoint.resume=none",
            ],
            rc=0,
            timeout=400,
            has=("step      2/2",),
        ),
        Attempt(
            "C3-plan",
            "traceback",
            [*PLAN, *ZBV, "+world_size=2", "parallel.pp_layout=[4,0,0,0]"],
            has=("leaves pipeline rank 1",),
        ),
        Attempt(
            "C4", "crash mid-run", *cfg(*ZBV, *MOE_FULL, rc=2, has=("train.recompute=full",))[:2], env=two
        ),
        Attempt(
            "H1",
            "hang",
            [*PLAN, "model.seq_length=1000000000", "+world_size=1", "+device_memory_gb=80"],
            rc=(0, 2),
            timeout=300,
        ),
        Attempt("T1-nan", "traceback", *cfg(stage("nan"), rc=2, synthetic=False)[:2]),
        Attempt("T1-inf", "traceback", *cfg(stage("inf"), rc=2, synthetic=False)[:2]),
        Attempt("T6-full", "traceback", [*PLAN, "+world_size=4", "+plan_json=/dev/full"], rc=1),
        Attempt(
            "T6-link",
            "traceback",
            [*PLAN, "+world_size=2", "+search=true", "+device=cpu", "+link_timeout_s=0.01"],
            rc=(0, 2),
            timeout=300,
        ),
    ]


def checkpoint_field_repros(s: Setup) -> list[Attempt]:
    """T2 (a tensor's dtype), T5 (latest as a folder), K1 (malformed pieces), K2 (a resume past the end)."""
    w, six = s.work, "step_00000006"

    def tensor(field, value):
        def fn(m):
            first = next(iter(m["tensors"].values()))
            first[field] = value

        return fn

    def damaged(name, fn):
        return lambda: edit_meta(s.copy(name, "run") / six, fn)

    def single_branch_damaged():
        shutil.rmtree(s.p("t2a"), ignore_errors=True)
        sh(s.syn("t2a", "train.max_steps=4", "checkpoint.interval=2"))
        edit_meta(s.p("t2a") / "checkpoints" / "step_00000004", tensor("dtype", "complex999"))

    def pieces(m):
        next(iter(m["tensors"].values()))["shards"][0]["pieces"] = [[1]]

    folder = lambda name, pointer: (
        lambda: (
            s.copy(name, "run"),
            (s.p(name) / "checkpoints" / pointer).unlink(  # noqa: E731
                missing_ok=True
            ),
            (s.p(name) / "checkpoints" / pointer).mkdir(),
        )
    )
    return [
        # one branch (the shared set-up has two: there a head without usable metadata is refused, naming both)
        Attempt(
            "T2-auto",
            "traceback",
            s.syn("t2a", "train.max_steps=6", "checkpoint.interval=2"),
            rc=0,
            prep=single_branch_damaged,
            has=("resumed from", "step_00000002"),
        ),
        Attempt(
            "T2-export",
            "traceback",
            [*EXPORT, str(s.p("t2b") / "checkpoints" / six), str(w / "t2b-hf")],
            prep=damaged("t2b", tensor("dtype", "complex999")),
            has=("dtype",),
        ),
        Attempt(
            "T5-dir",
            "traceback",
            s.run_tiny("t5a", "train.max_steps=7", "checkpoint.interval=1"),
            prep=folder("t5a", "latest"),
            has=("latest",),
        ),
        Attempt(
            "T5-tmp",
            "traceback",
            s.run_tiny("t5b", "train.max_steps=7", "checkpoint.interval=1"),
            prep=folder("t5b", "latest.tmp"),
            has=("latest.tmp",),
        ),
        Attempt(
            "K1-pieces",
            "message",
            [*CKPT_VERIFY, str(s.p("k1") / "checkpoints" / six)],
            prep=damaged("k1", pieces),
            has=("pieces",),
        ),
        Attempt(
            "K2-pastend",
            "message",
            s.run_tiny("k2", "train.max_steps=3"),
            rc=0,
            prep=lambda: s.copy("k2", "run"),
            has=("nothing to train",),
        ),
    ]


def disk_full(s: Setup) -> list[Attempt]:
    """DF: every writer on a full or size-limited file system stops with one line, leaving no half output."""
    w = s.work
    a = lambda i, cmd, **k: Attempt(f"DF{i:02d}", "disk full", cmd, **k)  # noqa: E731
    mnt = lambda i: w / "mnt" / f"df{i}"  # noqa: E731
    small = lambda i, size="256k", fill=0: lambda: mount_tmpfs(mnt(i), size, fill)  # noqa: E731
    off = lambda i: lambda: umount(mnt(i))  # noqa: E731
    d = Data(s)
    prep_cmd = lambda out: [
        *PREPARE,
        f"data.source={d.source('docs')}",
        f"data.path={out}",  # noqa: E731
        "data.num_workers=1",
        f"data.tokenizer={s.data / 'tokenizer.model'}",
    ]
    absent = lambda *paths: lambda: next((f"{p} was left" for p in paths if p.exists()), None)  # noqa: E731

    def ro(i):
        def prep():
            mount_tmpfs(mnt(i), "1m")
            import subprocess

            subprocess.run(["mount", "-o", "remount,ro", str(mnt(i))], check=True)

        return prep

    kib = lambda: _ckpt_bytes(s) * 3 // 2 // 1024  # noqa: E731
    return [
        a(
            1,
            prep_cmd(mnt(1) / "out"),
            rc=(1, 2),
            prep=lambda: (d.source("docs"), small(1, "64k")()),
            after=off(1),
            check=absent(mnt(1) / "out"),
        ),
        a(
            2,
            [*EXPORT, str(s.ck), str(mnt(2) / "hf")],
            rc=(1, 2),
            prep=small(2, "1m"),
            after=off(2),
            check=absent(mnt(2) / "hf", mnt(2) / "hf.tmp"),
        ),
        a(
            3,
            [*IMPORT, str(w / "hf"), str(mnt(3) / "ck"), f"data.path={s.data}"],
            rc=(1, 2),
            prep=lambda: (d.hf(), small(3, "1m")()),
            after=off(3),
            check=absent(mnt(3) / "ck" / "step_00000000"),
        ),
        a(
            4,
            fsize_limited(prep_cmd(w / "df4-out"), 32),
            rc=(1, 2),
            prep=lambda: (d.source("docs"), shutil.rmtree(w / "df4-out", ignore_errors=True)),
            check=absent(w / "df4-out"),
        ),
        a(
            5,
            fsize_limited([*EXPORT, str(s.ck), str(w / "df5-hf"), "--force"], 1024),
            rc=(1, 2),
            check=absent(w / "df5-hf"),
        ),
        a(
            6,
            s.syn("df6", "train.max_steps=1", f"run.dir={mnt(6) / 'run'}", f"checkpoint.dir={w / 'df6-ck'}"),
            rc=(0, 2),
            prep=small(6, "64k", fill=64 << 10),
            after=off(6),
        ),
        a(
            7,
            s.syn("df7", *SAVE, "checkpoint.async=true", f"checkpoint.dir={mnt(7) / 'ck'}"),
            rc=1,
            prep=lambda: mount_tmpfs(mnt(7), f"{kib() // 3}k"),
            after=off(7),
            has=("not committed",),
            check=_not_committed(mnt(7) / "ck", None),
        ),
        a(
            8,
            s.syn(
                "df8",
                *SAVE,
                "checkpoint.on_save_error=continue",
                "checkpoint.keep_last=1",
                f"checkpoint.dir={mnt(8) / 'ck'}",
            ),
            rc=0,
            prep=lambda: mount_tmpfs(mnt(8), f"{kib()}k"),
            after=off(8),
            has=("not committed", "step      3/3"),
            check=_not_committed(mnt(8) / "ck", "step_00000001"),
        ),
        a(
            9,
            py("-m", "megaframe.plot", str(s.rb), "--out", str(mnt(9) / "loss.png")),
            rc=(1, 2),
            prep=small(9, "64k", fill=64 << 10),
            after=off(9),
        ),
        a(
            10,
            [*PLAN, "+world_size=4", f"+plan_json={mnt(10) / 'plan.json'}"],
            prep=small(10, "64k", fill=64 << 10),
            after=off(10),
        ),
        a(
            11,
            s.syn("df11", "train.max_steps=1", f"checkpoint.dir={mnt(11) / 'ck'}"),
            prep=ro(11),
            after=off(11),
        ),
    ]


def schedules(s: Setup) -> list[Attempt]:
    """SV: odd pipeline layouts and schedules either run (checked on two real ranks) or are refused at load
    with one line; the planner says the same."""
    w = s.work
    a = lambda i, cmd, **k: Attempt(f"SV{i:02d}", "schedule validity", cmd, **k)  # noqa: E731
    two, four = {"WORLD_SIZE": "2"}, {"WORLD_SIZE": "4"}
    conf = lambda *o, rc=2, env=two: dict(cmd=[*TRAIN, *TINY4, "data=synthetic", *o, "--cfg"], rc=rc, env=env)  # noqa: E731
    real = lambda run, *o: [
        *TORCHRUN2,
        *TINY4,
        "data=synthetic",
        "train.max_steps=2",
        "checkpoint.resume=none",  # noqa: E731
        f"run.dir={w / run}",
        *o,
    ]
    inter = ["parallel.pp=2", "parallel.vpp=2"]
    return [
        a(
            1,
            real("sv1", "parallel.pp=2", "parallel.pp_schedule=zb_h1", "parallel.pp_layout=[1,3]"),
            rc=0,
            timeout=400,
            has=("step      2/2",),
        ),
        a(2, real("sv2", *inter, "parallel.pp_layout=[1,2,0,1]"), rc=0, timeout=400, has=("step      2/2",)),
        a(3, **conf(*ZBV, "parallel.pp_layout=[0,0,0,4]")),
        a(4, **conf(*inter, "model.num_layers=3", rc=(0, 2))),
        a(5, **conf(*inter, "train.global_batch_size=6")),
        a(6, **conf("parallel.pp=2", "parallel.vpp=3", "parallel.pp_schedule=zbv")),
        a(7, **conf("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zb_h1")),
        a(8, **conf("parallel.pp=2", "parallel.pp_layout=[1,2]")),
        a(9, **conf("parallel.pp=2", "parallel.pp_layout=[-1,5]")),
        a(10, **conf("parallel.pp=2", "model.num_layers=1")),
        a(
            11,
            **conf(
                "parallel.pp=2",
                "parallel.pp_schedule=zb_h1",
                "model=moe_tiny",
                "train.global_batch_size=12",
                "train.recompute=selective",
                rc=(0, 2),
            ),
        ),
        a(12, [*PLAN, *ZBV, *MOE_FULL, "+world_size=2"], has=("train.recompute=full",)),
        a(13, **conf("parallel.pp=4", "model.num_layers=2", env=four)),
        a(14, **conf(*inter, "parallel.pp_layout=[0,0,4,0]", rc=(0, 2))),
        a(15, **conf(*ZBV, "parallel.pp_layout=[1,1,2]")),
        a(16, **conf(*ZBV, "train.global_batch_size=2", rc=(0, 2))),
        a(17, [*PLAN, *ZBV, "+world_size=2", "parallel.pp_layout=[3,0,0,1]"], rc=(0, 2)),
    ]


def disk_schedule_attempts(s: Setup) -> list[Attempt]:
    return disk_repros(s) + schedule_repros(s) + checkpoint_field_repros(s) + disk_full(s) + schedules(s)
