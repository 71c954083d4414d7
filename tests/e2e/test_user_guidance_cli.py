"""What a run tells its user, through train.py as a user runs it.

The Ctrl-C stop message prints the command that continues the run, and that command does continue it.
Start-up warns about an lr curve the run will not follow to the end. The header names the ZeRO stage.
The stop step is logged (the summary's final loss is the stopped step's), and the checkpoint line comes
before the run summary. The torchrun failure summary is checked on the torchrun that
tests/e2e/test_train_cli.py::test_torchrun_refuses_tp_that_does_not_divide_world runs (the same command).
"""

import re
import shlex
import signal
import sys
import time

import pytest

from tests.e2e.helpers import ROOT, TINY, metrics, run, start

pytestmark = pytest.mark.e2e

SYN = [
    "data=synthetic",
    *TINY,
    "train.log_interval=1000",
    "train.signal_check_interval=1",
    "logging.wandb.mode=disabled",
]


def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path):
    """A plain `python train.py` (no run.dir, no MEGAFRAME_RUN_NAME): one name for the header's folder, the
    checkpoints and the stop line, whose command continues that folder's run and its wandb run. Before: three
    timestamps, and the printed command trained from step 1 in a third folder (and a second wandb id)."""
    train_py = str(ROOT / "train.py")
    wandb_env = dict(WANDB_MODE="offline", WANDB_SILENT="true")
    proc = start(
        [sys.executable, train_py, *SYN, "logging.wandb.mode=offline", "train.max_steps=100000"],
        cwd=tmp_path,
        **wandb_env,
    )
    t0 = time.time()
    while not list(tmp_path.glob("outputs/*/config.yaml")) or time.time() - t0 < 1:
        assert proc.poll() is None and time.time() - t0 < 120, proc.output()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:]
    assert "zero=1 (optimizer state sharded over dp=1)" in out, out[:2000]  # F10: before, no ZeRO stage
    stop = re.search(
        r"stopping at step (\d+) after SIGINT; checkpoint saved; continue with: python train\.py (.*)", out
    )
    assert stop, out[-2000:]  # before: "...; checkpoint saved" and nothing on how to go on
    step, cmd = int(stop.group(1)), shlex.split(stop.group(2))
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/config.yaml")]  # one folder
    name = run_dir.name
    assert f"run outputs/{name} " in out and "optim.lr=3e-3" in cmd and f"run.name={name}" in cmd, out[:2000]
    # F11: the stop step has its row (before: the last log_interval row), and the save line precedes the
    # summary
    assert metrics(run_dir)[-1]["step"] == step
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    assert f"final loss {metrics(run_dir)[-1]['loss']:.4f}" in out
    assert out.index(f"checkpoint: outputs/{name}/checkpoints/step_{step:08d}") < out.index("run summary:")

    # the printed command continues the run (two more steps); the lr horizon is the first start's 100000
    res = run([sys.executable, train_py, *cmd, f"train.max_steps={step + 2}"], 180, cwd=tmp_path, **wandb_env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from outputs/{name}/checkpoints/step_{step:08d}" in res.stdout + res.stderr
    # F9: before, a run ending before its recorded decay horizon said nothing
    assert f"train.max_steps={step + 2} < the decay horizon 100000" in res.stderr, res.stderr[-2000:]
    assert metrics(run_dir)[-1]["step"] == step + 2
    assert [p.parent for p in tmp_path.glob("outputs/*/config.yaml")] == [run_dir]
    # one wandb run for the folder: both starts under the id its recorded identity gives
    from tests.slurm.wandb_history import folder_run_id, segments

    rid = folder_run_id(run_dir)
    segs = segments(run_dir, None)
    assert len(segs) == 2 and {s["id"] for s in segs} == {rid}, segs
    assert rid.startswith(name.replace(".", "-"))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A prepared corpus of 12 files (its own sentencepiece tokenizer) and a 1-step run on it."""
    from megaframe.data import prepare as prep

    tmp = tmp_path_factory.mktemp("small")
    src = tmp / "corpus"
    src.mkdir()
    for i in range(12):
        (src / f"doc{i}.txt").write_text(
            f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 40
        )
    data = tmp / "data"
    assert prep.main([f"data.source={src}", f"data.path={data}", "data.vocab_size=300"]) == 0
    res = run(
        [
            sys.executable,
            "train.py",
            *TINY,
            f"data.path={data}",
            "train.max_steps=1",
            "logging.wandb.mode=disabled",
            f"run.dir={tmp / 'run'}",
        ],
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "run summary: 1 step (1..1)," in res.stdout, res.stdout[-1500:]  # before: "1 steps"
    return data, tmp / "run"


def test_evaluate_says_which_samples_and_whether_the_run_trained_on_them(small_run, capsys):
    """F4: `evaluate` called 8,192 training tokens "[all]", and with the README's data.valid_fraction=0.05 on
    a run trained without a split called documents it trained on "[valid]"."""
    from megaframe import evaluate

    capsys.readouterr()
    ckpt = str(small_run[1] / "checkpoints")
    assert evaluate.main([ckpt, "1"]) == 0
    cap = capsys.readouterr()
    assert re.search(r"\[all: the first 16 of 499 samples, trained on\]", cap.out), cap.out  # before: "[all]"
    assert "these are the run's training samples" in cap.err

    assert evaluate.main([ckpt, "data.valid_fraction=0.2", "1"]) == 0
    cap = capsys.readouterr()
    assert re.search(r"\[valid: .*, trained on\]", cap.out), cap.out  # before: "[valid]", nothing said
    assert "trained on this data with data.valid_fraction=0.0" in cap.err


def test_hf_round_trip_continues_on_the_original_data_and_prints_a_command_that_runs(
    small_run, tmp_path, capsys
):
    """F5: export -> import could not reuse the run's own prepared data (refused: "transformers ... vs
    sentencepiece"), and the import printed a train command on data=demo that the tokenizer check refused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import export_hf
    import import_hf

    from megaframe.config import load_config

    data, run_dir = small_run
    assert export_hf.main([str(run_dir / "checkpoints"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    # the round trip: the run's own data, as is
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "back"), f"data.path={data}"]) == 0
    out = capsys.readouterr().out
    cmd = out.split("continue pretraining with:\n")[1].split()
    assert cmd[:3] == ["python", "train.py", f"checkpoint.resume={tmp_path / 'back' / 'step_00000000'}"], out
    cfg = load_config(cmd[2:] + ["train.max_steps=1"], world_size=1)  # before: exit 2, the tokenizer check
    assert cfg.data.path == str(data)

    # the README's example, data=demo (another tokenizer, or not prepared): prepare first, then train on that
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "demo"), "data=demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prep_line = next(ln.split() for ln in lines if "megaframe.data.prepare" in ln)
    assert f"data.tokenizer={(tmp_path / 'demo' / 'hf_tokenizer').resolve()}" in prep_line
    train_line = next(ln for ln in lines if "python train.py" in ln)
    assert (
        "data=demo" not in train_line and "data.path=DATA" in train_line
    )  # before: "... data=demo", refused
