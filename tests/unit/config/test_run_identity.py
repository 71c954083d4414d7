"""One run identity per start: the name is worked out once per load (run.name, run.dir and checkpoint.dir
agree), the stop line's command loads the same folders, torchrun's workers and restarts get one readable
name, and the wandb id follows the run folder's recorded identity across starts. In-process, no training."""

import os
import re
import shlex
import uuid
from pathlib import Path
from types import SimpleNamespace

from megaframe.config import load_config
from megaframe.config.loading import default_run_name
from megaframe.runops.access import owner
from megaframe.runops.signals import continue_command

PLAIN = {"PATH": "/usr/bin"}  # no MEGAFRAME_RUN_NAME, torchrun or Slurm variables


def _no_launcher(monkeypatch):
    for var in ("MEGAFRAME_RUN_NAME", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_one_name_for_the_run_folder_and_its_checkpoints(monkeypatch):
    """Before: the resolver ran once per interpolation, three timestamps in one config."""
    _no_launcher(monkeypatch)
    cfg = load_config(["data=synthetic"])
    assert cfg.run.dir == f"outputs/{cfg.run.name}"
    assert cfg.checkpoint.dir == f"outputs/{cfg.run.name}/checkpoints"
    assert load_config(["data=synthetic"]).run.name != cfg.run.name  # another start, another run


def test_the_printed_continue_command_loads_the_same_folders(monkeypatch):
    _no_launcher(monkeypatch)
    argv = ["data=synthetic", "train.log_interval=1"]
    first = load_config(argv)
    line = continue_command(first.run.name, argv, env=PLAIN)
    args = shlex.split(line.split("continue with: python train.py ", 1)[1])
    again = load_config(args)
    assert (again.run.dir, again.checkpoint.dir) == (first.run.dir, first.checkpoint.dir), line


def test_torchrun_gets_one_readable_name_for_every_worker_and_restart(monkeypatch):
    """Before: the bare UUID of `--standalone` (or, with torchrun's "none", a new timestamp per restart)."""
    _no_launcher(monkeypatch)
    rid = str(uuid.uuid4())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", rid)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", default_run_name())
    from megaframe.config.loading import torchrun_run_name

    agent = os.getpid()  # a live process standing for the agent: its start time is fixed
    name = torchrun_run_name(rid, agent)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", name), name
    assert torchrun_run_name(rid, agent) == name  # another worker, or a restart under the same agent
    assert torchrun_run_name(str(uuid.uuid4()), agent) != name  # another torchrun
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", torchrun_run_name("none", agent))
    env = {"TORCHELASTIC_RUN_ID": rid}
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", default_run_name(env))
    assert default_run_name({"TORCHELASTIC_RUN_ID": "myjob"}) == "myjob"  # --rdzv-id: the user's name
    assert default_run_name({**env, "MEGAFRAME_RUN_NAME": "mine"}) == "mine"


def test_the_wandb_id_follows_the_run_folder_across_starts(tmp_path):
    """Three starts in one run.dir, each with another default run name (run.dir given, no run.name): one
    identity recorded at the first, one wandb id. Before: the id was the run name, one wandb run per start."""
    from megaframe.tracking import wandb_id

    run_dir = tmp_path / "b"
    run_dir.mkdir()
    ids = set()
    for start in range(3):
        run = SimpleNamespace(dir=str(run_dir), name=f"20261206-0554{start}7.814-d9014{start}")
        ck = SimpleNamespace(dir=str(run_dir / "checkpoints"), resume="auto")
        ids.add(wandb_id(owner.settle(run, ck), run.name))
    (rid,) = ids
    assert rid.startswith("20261206-055407-814-d90140-") and len(rid) <= 64
    other = tmp_path / "c"
    other.mkdir()
    run = SimpleNamespace(dir=str(other), name="20261206-055407.814-d90140")
    assert wandb_id(owner.settle(run, SimpleNamespace(dir=str(other / "ck"), resume="auto")), "x") != rid
    long = wandb_id("n" * 80 + "@20261206-055407-abcdef", "")
    assert len(long) == 64 and re.fullmatch(r"[A-Za-z0-9_-]+", long)


def test_wandb_history_reads_the_folders_own_run_and_refuses_an_empty_folder(tmp_path, capsys):
    """Before: `python -m tests.slurm.wandb_history runs/b` looked for an id equal to the folder's name,
    printed nothing and exited 0."""
    from megaframe.tracking import wandb_id
    from tests.slurm import wandb_history

    run_dir = tmp_path / "b"
    run_dir.mkdir()
    assert wandb_history.main([str(run_dir)]) == 2
    assert "no offline wandb run" in capsys.readouterr().err
    rid = wandb_id(
        owner.settle(
            SimpleNamespace(dir=str(run_dir), name="n"),
            SimpleNamespace(dir=str(run_dir / "ck"), resume="auto"),
        ),
        "",
    )
    assert wandb_history.folder_run_id(Path(run_dir)) == rid


def test_a_run_name_that_is_no_folder_name_is_one_line(monkeypatch, tmp_path):
    """run.name becomes outputs/<run.name>: an empty name wrote into outputs/ itself, a `..` part outside it,
    and a name past the file system's 255 bytes was an OSError traceback."""
    import pytest

    from megaframe.config import ConfigError

    monkeypatch.chdir(tmp_path)
    for name, says in (("", "must not be empty"), ("../../escape", "`..` part"), ("n" * 300, "255 bytes")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(["data=synthetic", f"run.name={name}"])
    assert load_config(["data=synthetic", "run.name=group/exp"]).run.dir == "outputs/group/exp"
