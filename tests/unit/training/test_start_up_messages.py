"""What a run says before its first step, checked without a launch: the CPU threads per rank and the
busy-machine warning, the header's precision / pipeline / held-out labels, FP8's warnings, the continue hint,
the README's first commands free of lr warnings, `train.py --help`, and transformers' torchao noise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.runops.signals import continue_command

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("extra", [1, 100000, 2**31])
def test_threads_far_above_the_machines_cpus_are_one_line_exit_2(extra):
    """train.threads=100000 started 100000 OpenMP threads and ended in a segmentation fault (rc 139)."""
    import os

    bound = 4 * (os.cpu_count() or 1)
    asked = bound + extra if extra < 2**31 else extra
    with pytest.raises(ConfigError, match=rf"^train.threads={asked} must be <= {bound} \(4 per CPU of"):
        load_config(["data=synthetic", f"train.threads={asked}"], world_size=1)
    assert load_config(["data=synthetic", f"train.threads={bound}"], world_size=1).train.threads == bound


def test_threads_above_the_cpus_of_the_node_are_a_warning():
    from megaframe.training.threads import Threads, oversubscribed_warning

    key = Threads(3, "train.threads")
    assert oversubscribed_warning(key, 1, cpus=4) is None
    line = oversubscribed_warning(key, 2, cpus=4)
    assert line and line.startswith("train.threads=3 x 2 rank(s) on this node is above its 4 CPUs")
    assert oversubscribed_warning(Threads(8, "8 cores / 1 rank"), 1, cpus=4) is None  # not the user's


def test_threads_come_from_the_key_then_omp_then_cores_over_local_ranks():
    from megaframe.training.threads import pick_threads

    assert pick_threads(3, {"OMP_NUM_THREADS": "1"}).count == 3  # the key wins
    omp = pick_threads(None, {"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "8"})
    assert (omp.count, omp.source) == (2, "OMP_NUM_THREADS")
    from megaframe.training.threads import usable_cores

    cores = usable_cores()
    two = pick_threads(None, {"LOCAL_WORLD_SIZE": "2"})
    assert two.count == max(1, cores // 2) and two.label == f"threads {two.count} ({cores} cores / 2 ranks)"
    assert pick_threads(None, {"LOCAL_WORLD_SIZE": str(4 * cores)}).count == 1  # never 0
    with pytest.raises(ConfigError, match=r"train.threads=0 must be >= 1"):
        load_config(["data=synthetic", "train.threads=0"], world_size=1, check_data=False)


def test_busy_machine_warns_once_with_the_load_and_the_way_out():
    from megaframe.training.threads import load_warning

    line = load_warning(5.4, 2, threads=2)
    assert "load average 5.4 on 2 cores" in line and "idle machine" in line and "train.threads=1" in line
    assert "train.threads" not in load_warning(5.4, 2, threads=1)  # already one thread: nothing to suggest
    assert load_warning(1.9, 2, threads=2) is None


def test_header_labels_precision_schedule_and_fp8_warnings():
    from megaframe.training.header import pipeline_label, precision_label, precision_warnings

    def cfg(*over, world=1):
        return load_config(["data=synthetic", *over], world_size=world, check_data=False)

    assert precision_label(cfg()) == "precision fp32" and pipeline_label(cfg()) == ""
    assert precision_label(cfg("train.precision=bf16")) == "precision bf16 (fp32 master weights)"
    fp8 = cfg("train.precision=fp8")
    assert "float8 tensorwise GEMMs" in precision_label(fp8)
    zbv = cfg("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv", world=2)
    assert pipeline_label(zbv) == " schedule zbv vpp=2"
    assert pipeline_label(cfg("parallel.pp=2", world=2)) == " schedule 1f1b"  # auto, resolved
    # a forward beside a backward is worth seeing without a pipeline too
    assert pipeline_label(cfg("parallel.pp_schedule=1f1b_overlap")) == " schedule 1f1b_overlap"
    [cpu] = precision_warnings(fp8, "cpu")
    assert "emulated" in cpu and "train.compile=true" in cpu
    [cuda] = precision_warnings(fp8, "cuda")
    assert "without train.compile=true" in cuda and "0.40x" in cuda
    assert precision_warnings(cfg("train.precision=fp8", "train.compile=true"), "cuda") == []
    assert precision_warnings(cfg("train.precision=bf16"), "cpu") == []


def test_header_names_the_validation_split_it_holds_out(demo_prepared):
    from megaframe.training.header import held_out_label
    from tests.forms import build_data

    cfg = load_config(["data=demo", f"data.path={demo_prepared}", "data.valid_fraction=0.05"], world_size=1)
    train, valid = build_data(cfg), build_data(cfg, split="valid")
    label = held_out_label(cfg, SimpleNamespace(evaluator=None, data=train))
    share = 100 * valid.num_samples / (valid.num_samples + train.num_samples)
    assert label == f" (+{valid.num_samples} held out for validation, {share:.1f}%)"
    plain = load_config(["data=demo", f"data.path={demo_prepared}"], world_size=1)
    assert held_out_label(plain, SimpleNamespace(evaluator=None, data=train)) == ""


def test_continue_hint_names_the_run_only_without_run_dir():
    hint = continue_command(
        "a51d1aa9", ["data=synthetic", "run.dir=runs/sig"], env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    )
    assert hint == "; continue with: torchrun --nproc-per-node=2 train.py data=synthetic run.dir=runs/sig"
    assert "run.name=x" in continue_command("x", ["data=synthetic"], env={})


def test_readme_day_one_commands_print_no_lr_warnings():
    """The README's own train commands, as a user types them (no test appendix), against the lr horizon
    their run will have (a resume keeps the horizon of the run it resumes)."""
    from megaframe.optim.lr_schedule import schedule_warnings
    from tests.e2e.docs_commands import commands, hydra_overrides, tokens

    horizons, checked = {}, 0
    for c in commands("README.md"):
        tool, over = hydra_overrides(c)
        if tool != "train.py" or c.expected_exit:
            continue
        resume = next((o.split("=", 1)[1] for o in over if o.startswith("checkpoint.resume=")), None)
        world = next((int(w.split("=")[1]) for w in tokens(c) if w.startswith("--nproc-per-node=")), 1)
        cfg = load_config(
            [o for o in over if not o.startswith("checkpoint.resume=")], world_size=world, check_data=False
        )
        steps = cfg.train.max_steps
        horizon = horizons.get(resume.split("/checkpoints")[0]) if resume else None
        optim = SimpleNamespace(**{**vars(cfg.optim), "lr_decay_steps": horizon or cfg.optim.lr_decay_steps})
        assert schedule_warnings(optim, steps) == [], f"{c.where}: `{c.code}`"
        horizons[cfg.run.dir] = horizon or steps
        checked += 1
    assert checked >= 4


def test_help_points_to_the_config_reference():
    res = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and "docs/config.md" in res.stdout, res.stdout
    # the groups with every preset, and the keys a first run sets with their defaults
    from megaframe.config.schema import CONF_DIR

    for group in ("model", "data"):
        assert f"  {group}=NAME:" in res.stdout
        assert all(f"    {p.stem} " in res.stdout for p in (CONF_DIR / group).glob("*.yaml")), res.stdout
    for key in (
        "train.max_steps=300",
        "optim.warmup_steps=20",
        "model.seq_length=",
        "checkpoint.resume=auto",
    ):
        assert f"  {key}" in res.stdout, res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 110


def test_hf_interop_import_prints_no_torchao_loader_lines():
    """transformers imports torchao whenever it is installed; its loader warnings say nothing a user of
    export/import (or an fp32 run) can act on."""
    code = "import megaframe.checkpoint.hf\nfrom transformers import LlamaForCausalLM  # noqa: F401\n"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Failed to load" not in res.stderr and "register_constant" not in res.stderr, res.stderr[-2000:]
