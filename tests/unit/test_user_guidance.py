"""What a run tells its user, checked without a process: the command that continues a run under each
launcher, warnings about an lr curve the run will not follow, the files prepare skips, which samples
evaluate scored, presets over another preset's checkpoint, an unknown preset's closest name."""

import json
from types import SimpleNamespace

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.config.schema import LRSchedule
from megaframe.optim.lr_schedule import schedule_warnings
from megaframe.runops.signals import continue_command


def test_continue_command_under_python_make_torchrun_and_slurm():
    argv = ["model=gpt2_tiny", "checkpoint.resume=outputs/a/checkpoints/step_00000005", "run.name=old"]
    assert (
        continue_command("scale", argv, env={})
        == "; continue with: python train.py model=gpt2_tiny run.name=scale"
    )
    make = continue_command("demo-1", [], env={"MEGAFRAME_RUN_NAME": "demo-1"})
    assert make == "; continue with: python train.py run.name=demo-1 (or: make train RUN=demo-1)"
    tr = continue_command("scale", ["parallel.tp=2"], env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert tr == "; continue with: torchrun --nproc-per-node=4 train.py parallel.tp=2 run.name=scale"
    blend = continue_command("b", ["data.blend=[{path: a, weight: 1}]"], env={})
    assert "'data.blend=[{path: a, weight: 1}]'" in blend  # quoted: pasted into a shell it stays one argument
    slurm = continue_command("mf-42", ["model=llama_1b"], env={"SLURM_JOB_ID": "42", "WORLD_SIZE": "64"})
    assert slurm == "; continue with: MEGAFRAME_RUN_NAME=mf-42 sbatch <your job script> model=llama_1b"


def test_a_self_requeueing_job_says_so_and_a_resubmission_names_the_submitted_script():
    """Before: every Slurm stop printed `sbatch scripts/slurm/pretrain.sbatch ...`, also when the job
    requeues itself and when another script was submitted."""
    import signal

    job = {"SLURM_JOB_ID": "42", "WORLD_SIZE": "4", "MEGAFRAME_JOB_SCRIPT": "/site/my-cpu.sbatch"}
    usr1 = continue_command("mf-42", ["model=llama_1b"], env=job, signum=signal.SIGUSR1)
    assert usr1 == "; my-cpu.sbatch requeues job 42 to continue it"
    term = continue_command("mf-42", ["model=llama_1b"], env=job, signum=signal.SIGTERM)
    assert term == "; continue with: MEGAFRAME_RUN_NAME=mf-42 sbatch /site/my-cpu.sbatch model=llama_1b"


def _optim(**kw):
    base = dict(
        lr=2e-3,
        min_lr=2e-4,
        warmup_steps=20,
        lr_decay_steps=None,
        lr_schedule=LRSchedule.cosine,
        wsd_decay_fraction=0.2,
    )
    return SimpleNamespace(**{**base, **kw})


def test_schedule_warnings_for_the_notes_three_cases():
    # a 10-step run with the default 20 warmup steps ends halfway up (lr 1.0e-3) and records horizon 10
    ten = schedule_warnings(_optim(lr_decay_steps=10), 10)
    assert any("ends inside the warmup, at lr 1.00e-03" in w for w in ten), ten
    # resumed to 20 with that horizon: the lr falls from 2e-3 to min_lr at step 21
    assert any(
        "falls from its peak to optim.min_lr=2.00e-04 at step 21" in w
        for w in schedule_warnings(_optim(lr_decay_steps=10), 20)
    )
    # a 300-step horizon cut to 200 (the note: lr 6.4e-4 with the demo's lr): it ends above min_lr
    short = schedule_warnings(_optim(lr_decay_steps=300), 200)
    assert short and "ends at lr 7.10e-04" in short[0] and "optim.lr_decay_steps=200" in short[0], short
    # the ordinary run says nothing
    assert schedule_warnings(_optim(lr_decay_steps=300), 300) == [] == schedule_warnings(_optim(), 500)
    assert schedule_warnings(_optim(lr_schedule=LRSchedule.constant, lr_decay_steps=300), 200) == []


def test_prepare_names_the_files_it_skips_and_reads_dotted_extensionless_names(tmp_path, capsys):
    """F3: Debian's doc folder lost 70 of 399 files without a word; `libglib2.0-0__copyright` (a version's
    dot, not an extension) was one of them. Now it is sniffed in like any extension-less text file, and the
    rest is one line by reason, the names in meta.json."""
    from megaframe.data import prepare as prep

    src = tmp_path / "docs"
    src.mkdir()
    text = "Copyright 2020 the authors. Permission is granted to copy and modify this text.\n" * 20
    for name in ("libglib2.0-0__copyright", "libboost-filesystem1.74.0__copyright", "zlib__README.md"):
        (src / name).write_text(text)
    for name in ("a__README.Debian", "b__README.Debian", "c__README.source"):
        (src / name).write_text(text)
    (src / "pkg__empty.txt").write_text("")
    out = tmp_path / "out"
    rc = prep.main([f"data.source={src}", f"data.path={out}", "data.vocab_size=300"])
    stdout = capsys.readouterr().out
    assert rc == 0
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(r["rel"] for r in meta["sources"]) == [
        "libboost-filesystem1.74.0__copyright",
        "libglib2.0-0__copyright",
        "pkg__empty.txt",
        "zlib__README.md",
    ]
    assert "skipped 4 of 7 files (2 x .debian, 1 x .source, 1 x empty)" in stdout, stdout
    assert meta["skipped"] == {
        ".debian": ["a__README.Debian", "b__README.Debian"],
        ".source": ["c__README.source"],
        "empty": ["pkg__empty.txt"],
    }
    # the phases, as they start; the empty file is skipped, not tokenized
    assert "training a tokenizer (vocab 300)" in stdout and "tokenizing 3 files" in stdout


def test_evaluate_trained_on_follows_the_runs_held_out_fraction(tmp_path):
    """F4: the held-out documents of a fraction are a prefix of one fixed order: a split no larger than the
    run's is held out; a larger one, or no split, is data the run trained on; other data says nothing."""
    from megaframe.evaluate import trained_on

    def cfg(*over):
        return load_config([f"data.path={tmp_path / 'd'}", *over], world_size=1, check_data=False)

    meta = {"config": {"data": {"path": str(tmp_path / "d"), "valid_fraction": 0.05, "blend": []}}}
    assert trained_on(meta, cfg("data.valid_fraction=0.05")) is None
    assert trained_on(meta, cfg("data.valid_fraction=0.02")) is None
    assert "holds documents it trained on" in trained_on(meta, cfg("data.valid_fraction=0.1"))
    assert "training samples" in trained_on(meta, cfg())
    other = {"config": {"data": {"path": str(tmp_path / "other"), "valid_fraction": 0.0}}}
    assert trained_on(other, cfg("data.valid_fraction=0.1")) is None


def test_a_preset_over_another_presets_checkpoint_names_both(tmp_path):
    """F1 (cosmetic): `model=gpt_tiny` over a gpt2_tiny checkpoint blamed `model.num_query_groups=2`, an
    override the user never typed."""
    from megaframe.config.schema import plain

    ck = tmp_path / "step_00000005"
    ck.mkdir()
    base = load_config(["model=gpt2_tiny"], world_size=1, check_data=False)
    (ck / "metadata.json").write_text(json.dumps({"step": 5, "config": plain(base)}))
    with pytest.raises(ConfigError) as e:
        load_config(["model=gpt_tiny", f"checkpoint.resume={ck}"], world_size=1, check_data=False)
    msg = str(e.value)
    assert (
        msg.startswith("model=gpt_tiny (model.") and "a gpt2_tiny" in msg and "drop model=gpt_tiny" in msg
    ), msg
    with pytest.raises(ConfigError) as e:  # a field typed out is still named as typed
        load_config(["model.num_layers=2", f"checkpoint.resume={ck}"], world_size=1, check_data=False)
    assert str(e.value).startswith("model.num_layers=2 contradicts the checkpoint's model.num_layers=4")


def test_an_unknown_preset_is_one_line_with_the_closest_name_and_no_search_path():
    """F11: `model=gpt2_tinyy` listed the presets, then Hydra's config search path on the same line."""
    with pytest.raises(ConfigError) as e:
        load_config(["model=gpt2_tinyy"], world_size=1, check_data=False)
    msg = str(e.value)
    assert msg.startswith("model=gpt2_tinyy: no such model preset; did you mean gpt2_tiny?"), msg
    assert "search path" not in msg and "gpt_tiny" in msg
