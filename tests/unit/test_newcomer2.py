"""The second newcomer trial's frictions (shared/notes/newcomer-2.md) that need no process: F8's continue
command under each launcher, F9's lr-curve warnings with the note's own numbers."""
from types import SimpleNamespace

from megaframe.optim.schedule import schedule_warnings
from megaframe.schema import LRSchedule
from megaframe.training.signals import continue_command


def test_continue_command_under_python_make_torchrun_and_slurm():
    argv = ["model=gpt2_tiny", "checkpoint.resume=outputs/a/checkpoints/step_00000005", "run.name=old"]
    assert continue_command("scale", argv, env={}) == "; continue with: python train.py model=gpt2_tiny run.name=scale"
    make = continue_command("demo-1", [], env={"MEGAFRAME_RUN_NAME": "demo-1"})
    assert make == "; continue with: python train.py run.name=demo-1 (or: make train RUN=demo-1)"
    tr = continue_command("scale", ["parallel.tp=2"], env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert tr == "; continue with: torchrun --nproc-per-node=4 train.py parallel.tp=2 run.name=scale"
    blend = continue_command("b", ["data.blend=[{path: a, weight: 1}]"], env={})
    assert "'data.blend=[{path: a, weight: 1}]'" in blend  # quoted: pasted into a shell it stays one argument
    slurm = continue_command("mf-42", ["model=llama_1b"], env={"SLURM_JOB_ID": "42", "WORLD_SIZE": "64"})
    assert slurm == "; continue with: MEGAFRAME_RUN_NAME=mf-42 sbatch scripts/slurm/pretrain.sbatch model=llama_1b"


def _optim(**kw):
    base = dict(lr=2e-3, min_lr=2e-4, warmup_steps=20, lr_decay_steps=None, lr_schedule=LRSchedule.cosine,
                wsd_decay_fraction=0.2)
    return SimpleNamespace(**{**base, **kw})


def test_schedule_warnings_for_the_notes_three_cases():
    # a 10-step run with the default 20 warmup steps ends halfway up (lr 1.0e-3) and records horizon 10
    ten = schedule_warnings(_optim(lr_decay_steps=10), 10)
    assert any("ends inside the warmup, at lr 1.00e-03" in w for w in ten), ten
    # resumed to 20 with that horizon: the lr falls from 2e-3 to min_lr at step 21
    assert any("falls from its peak to optim.min_lr=2.00e-04 at step 21" in w for w in schedule_warnings(
        _optim(lr_decay_steps=10), 20))
    # a 300-step horizon cut to 200 (the note: lr 6.4e-4 with the demo's lr): it ends above min_lr
    short = schedule_warnings(_optim(lr_decay_steps=300), 200)
    assert short and "ends at lr 7.10e-04" in short[0] and "optim.lr_decay_steps=200" in short[0], short
    # the ordinary run says nothing
    assert schedule_warnings(_optim(lr_decay_steps=300), 300) == [] == schedule_warnings(_optim(), 500)
    assert schedule_warnings(_optim(lr_schedule=LRSchedule.constant, lr_decay_steps=300), 200) == []
