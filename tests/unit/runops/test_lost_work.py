"""Nothing a run writes lands outside its folders or in another
job's; each test is a reproduction of the note (S1, L1, L2, T2, ...) that failed on the code before."""

import json
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.runops.access.runlock import LOCK_NAME, RunDirBusy, RunLock


def claim(cfg):
    from megaframe.runops.access.folders import claim as take

    return take(cfg.run, cfg.checkpoint)


def dirs(run_dir, ckpt_dir):
    return SimpleNamespace(
        run=SimpleNamespace(dir=str(run_dir)), checkpoint=SimpleNamespace(dir=str(ckpt_dir))
    )


@pytest.fixture
def no_job(monkeypatch):
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


# --- folders: S1, T2, L1 ---
@pytest.mark.parametrize(
    "override,key", [("run.dir=", "run.dir"), ("checkpoint.dir=", "checkpoint.dir"), ("run.dir=/", "run.dir")]
)
def test_an_empty_run_dir_is_refused_not_slash_checkpoints(override, key):
    """S1: run.dir=$RUN_DIR with RUN_DIR unset wrote to /checkpoints."""
    with pytest.raises(ConfigError, match=f"^{key}="):
        load_config(["data=synthetic", override], world_size=1)


def test_an_uncreatable_checkpoint_dir_is_refused_at_start(tmp_path, no_job):
    """T2: found at the first save, hours in, as a FileNotFoundError traceback."""
    with pytest.raises(ConfigError, match=r"^checkpoint.dir=/proc/megaframe-no/ck: cannot write there"):
        claim(dirs(tmp_path / "run", "/proc/megaframe-no/ck"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        load_config(["data=synthetic", f"checkpoint.dir={tmp_path / 'afile' / 'ck'}"], world_size=1)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # the run.dir lock taken first is given back


def test_two_runs_sharing_a_checkpoint_dir_the_second_is_refused(tmp_path, no_job):
    """L1: jobs with their own run.dir and one checkpoint.dir
    both exited 0, one replacing the other's checkpoints."""
    shared = tmp_path / "shared_ck"
    first = claim(dirs(tmp_path / "a", shared))
    try:
        with pytest.raises(ConfigError, match=f"^checkpoint.dir={shared} is in use by another run"):
            claim(dirs(tmp_path / "b", shared))
        assert not (tmp_path / "b" / LOCK_NAME).exists()
    finally:
        first.release()
    claim(dirs(tmp_path / "b", shared)).release()  # free again once the first run ended
    assert not (shared / LOCK_NAME).exists()


# --- lock takeover only from a holder proven gone: L2 and the stale lock on another host ---
def _lock(path, **holder):
    (path / LOCK_NAME).write_text(json.dumps({"since": time.time(), **holder}))


def test_the_same_slurm_job_never_takes_a_live_holders_lock(tmp_path, monkeypatch, no_job):
    """L2: two srun steps of one allocation share SLURM_JOB_ID; the second took over the live first's lock."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(tmp_path, host=socket.gethostname(), pid=holder.pid, job="SLURM_JOB_ID=778", restart=0)
        monkeypatch.setenv("SLURM_JOB_ID", "778")
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}, SLURM_JOB_ID=778"):
            RunLock(tmp_path).acquire()
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # even a "requeued" job: the pid here is alive
        with pytest.raises(RunDirBusy):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).acquire().release()  # dead now: taken over


def test_an_earlier_run_of_the_same_job_on_another_host_is_taken_over(tmp_path, monkeypatch, no_job):
    _lock(tmp_path, host="old-node", pid=1, job="SLURM_JOB_ID=5", restart=0)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    with pytest.raises(RunDirBusy):  # the same incarnation on another node: may be alive
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue: the old node's workers are gone
    RunLock(tmp_path).acquire().release()


@pytest.fixture(params=["squeue", "scontrol"])
def fake_squeue(tmp_path, monkeypatch, request):
    """Only a `squeue` (or only a `scontrol`) on PATH, answering like Slurm's for job 99 (state in
    $FAKE_SQUEUE; 'invalid' = purged from the controller)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    say = (
        'echo "$FAKE_SQUEUE"'
        if request.param == "squeue"
        else 'echo "JobId=99 JobName=x JobState=$FAKE_SQUEUE Reason=None"'
    )
    (bin_ / request.param).write_text(
        '#!/bin/sh\nif [ "$FAKE_SQUEUE" = invalid ]; then\n'
        '  echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi\n'
        f"{say}\n"
    )
    (bin_ / request.param).chmod(0o755)
    for tool in (
        "sh",
        "echo",
    ):  # the fake's own needs; nothing else of the host's PATH (its real Slurm commands)
        (bin_ / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_))
    return monkeypatch


@pytest.mark.parametrize(
    "state,taken",
    [
        ("COMPLETED", True),
        ("CANCELLED+", True),
        ("invalid", True),
        ("RUNNING", False),
        ("PENDING", False),
        ("", False),
    ],
)
def test_a_stale_lock_on_another_host_is_taken_over_when_slurm_reports_its_job_gone(
    tmp_path, fake_squeue, no_job, state, taken, capsys
):
    """Open item: a stale lock of a job on another host had to be removed by hand."""
    fake_squeue.setenv("FAKE_SQUEUE", state)
    (tmp_path / "run").mkdir()
    _lock(tmp_path / "run", host="node-17", pid=4242, job="SLURM_JOB_ID=99")
    if taken:
        RunLock(tmp_path / "run").acquire().release()
        assert "warning: taking over the lock" in capsys.readouterr().out
    else:
        with pytest.raises(RunDirBusy, match="host node-17"):
            RunLock(tmp_path / "run").acquire()


# --- one resolver of "the checkpoint to use": W1, W2, T1 ---
def rollback_dir(root):
    """Run A saved 2,4,6,8; a rollback B resumed from 2 and saved 3 and 5; `latest` names B's 5."""
    from tests.unit.runops.test_run_safety import fake_ckpt

    ids, parent = {}, (None, None)
    for s in (2, 4, 6, 8):
        d, ids[s] = fake_ckpt(root, s, "A", *parent)
        parent = (d, ids[s])
    parent = (root / "step_00000002", ids[2])
    for s in (3, 5):
        d, i = fake_ckpt(root, s, "B", *parent)
        parent = (d, i)
    return root


def test_tools_on_a_checkpoint_dir_use_the_live_branch_not_the_highest_step(tmp_path):
    """W1: generate and evaluate (inference/files.resolve_step) picked step_8 of the abandoned branch."""
    from megaframe.checkpoint import resolve
    from megaframe.inference.files import resolve_step

    rollback_dir(tmp_path)
    assert resolve.step_folder(tmp_path).name == "step_00000005"
    assert resolve_step(tmp_path)[0].name == "step_00000005"


@pytest.mark.parametrize("damage", ["garbage", "missing", "dotdot", "empty-meta", "list-meta", "binary"])
def test_an_unusable_latest_over_branches_is_refused_never_the_highest_step(tmp_path, damage):
    """W2: a missing or garbage `latest`, or an unreadable
    head, sent resume=auto (and the tools) to step_8."""
    from megaframe.checkpoint import resolve

    rollback_dir(tmp_path)
    latest = tmp_path / "latest"
    if damage == "garbage":
        latest.write_text("garbage\n")
    elif damage == "missing":
        latest.unlink()
    elif damage == "binary":  # a binary metadata file once gave a UnicodeDecodeError traceback
        latest.write_bytes(bytes(range(256)))
    elif damage == "dotdot":
        latest.write_text("../elsewhere/step_00000009\n")
    else:
        (tmp_path / "step_00000005" / "metadata.json").write_text("{}" if damage == "empty-meta" else "[]")
    tips = r"2 branches \(newest of each: step_00000008 \(run A\), step_0000000[35] \(run B\)\)"
    with pytest.raises(resolve.Unresolved, match=tips):
        resolve.resume_order(tmp_path)
    with pytest.raises(ValueError, match="form 2 branches"):
        resolve.step_folder(tmp_path)
    with pytest.raises(ConfigError, match="^checkpoint.resume=auto: .*latest"):
        load_config(["data=synthetic", f"checkpoint.dir={tmp_path}"], world_size=1)


def test_an_unusable_latest_over_one_branch_continues_it_with_a_warning(tmp_path):
    from megaframe.checkpoint import resolve
    from tests.unit.runops.test_run_safety import fake_ckpt

    d2, i2 = fake_ckpt(tmp_path, 2, "A")
    fake_ckpt(tmp_path, 4, "A", d2, i2)
    (tmp_path / "latest").unlink()
    said = []
    assert [p.name for p in resolve.resume_order(tmp_path, warn=said.append)] == [
        "step_00000004",
        "step_00000002",
    ]
    assert "latest is missing" in said[0]
    assert resolve.head(tmp_path / "nothing-here") is None  # no checkpoint: a fresh start


BAD_META = {
    "list": "[]",
    "null": "null",
    "no-tensors": '{"format": "%s", "step": 5, "coverage": "exact"}',
    "files-list": '{"format": "%s", "step": 5, "coverage": "exact", "files": [], "tensors": {}}',
    "shards-str": '{"format": "%s", "step": 5, "coverage": "exact", "files": {}, '
    '"tensors": {"model/w": {"shards": "x"}}}',
    # a lineage of the wrong type once gave a TypeError in every lineage reader; "resumed at step 999"
    "parent-int": '{"format": "%s", "step": 5, "coverage": "exact", "files": {}, "tensors": {}, '
    '"lineage": {"parent": 5}}',
    "step-other": '{"format": "%s", "step": 999, "coverage": "exact", "files": {}, "tensors": {}}',
}


@pytest.mark.parametrize("form", sorted(BAD_META))
def test_valid_json_that_is_not_a_checkpoint_is_one_line_in_every_reader(tmp_path, form, capsys):
    """T1: AttributeError / KeyError tracebacks in resume=auto, explicit resume, generate and verify."""
    from megaframe.checkpoint import lineage, sharded
    from megaframe.checkpoint.__main__ import main as verify_main
    from megaframe.inference.files import resolve_step

    step = tmp_path / "step_00000005"
    step.mkdir()
    text = BAD_META[form]
    (step / "metadata.json").write_text(text % sharded.FORMAT if "%s" in text else text)
    (tmp_path / "latest").write_text(step.name)
    assert lineage.cheap_check(step)  # resume=auto skips it with a reason
    with pytest.raises(sharded.CheckpointError, match=f"^{step}: "):
        sharded.read_metadata(step)
    with pytest.raises(ValueError, match=str(step)):
        resolve_step(step)  # generate, evaluate
    assert verify_main(["verify", str(step)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(ConfigError, match=f"^checkpoint.resume={step}: "):
        load_config(["data=synthetic", f"checkpoint.resume={step}"], world_size=1)


# --- field ranges and one-line errors: W3, W4, T3-T7, S2, C1, K2 ---
@pytest.mark.parametrize(
    "overrides,msg",
    [
        (["optim.lr=1e-3", "optim.min_lr=1"], "optim.min_lr=1.0 must be <= optim.lr=0.001"),  # W3
        (
            ["optim.warmup_steps=10", "optim.lr_decay_steps=1"],
            "optim.lr_decay_steps=1 must be > optim.warmup_steps=10",
        ),
        (["optim.warmup_steps=10", "optim.lr_decay_steps=10"], "optim.lr_decay_steps=10 must be >"),
        (
            ["data.blend=[{path: /a, weight: inf}, {path: /b, weight: 1}]"],
            r"data.blend\[0\].weight=inf must be finite",
        ),  # W4
        (["data.blend=[{path: /a, weight: 1e308}, {path: /b, weight: 1e308}]"], "sum to infinity"),
        (["train.dist_timeout_s=1e30"], "train.dist_timeout_s=1e.30 must be <= 1e.09"),  # T7
        (["checkpoint.save_timeout_s=1e14"], "checkpoint.save_timeout_s=.* must be <= 1e.09"),
        (["checkpoint.allow_config_change=[foo.bar]"], "names 'foo.bar', which is not a config key"),  # K4
        (["train.hang_timeout_s=1e-9"], "train.hang_timeout_s=1e-09 must be 0 .no watchdog. or >= 1"),  # K6
        (
            ["parallel.cp=2", "train.sample_interval=2", "model.seq_length=64"],  # C1
            "train.sample_interval=2 is not built with parallel.cp=2",
        ),
    ],
)
def test_fields_that_trained_nonsense_or_crashed_later_are_one_line_at_start(overrides, msg):
    world = 2 if "parallel.cp=2" in overrides else 1
    with pytest.raises(ConfigError, match=msg):
        load_config(["data=synthetic", *overrides], world_size=world)


def test_wsd_decay_fraction_one_is_accepted_as_its_message_says():
    """K2: refused by the field rule (`must be < 1`) while the schedule's message says (0, 1]."""
    assert (
        load_config(["data=synthetic", "optim.wsd_decay_fraction=1.0"], world_size=1).optim.wsd_decay_fraction
        == 1
    )


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaframe: error: "), err
    return err[0]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--prompt", "caf\udce9"], "is not UTF-8 text"),  # T3: argv bytes arrive surrogate-escaped
        (["--prompt", "The", "--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
        # an infinite temperature sampled uniformly; a negative or 2**64 seed failed inside torch
        (["--prompt", "The", "--temperature", "inf"], "--temperature inf must be a finite number >= 0"),
        (["--prompt", "The", "--seed", "-1"], "--seed -1 must be an integer >= 0 and < 9223372036854775808"),
        (["--prompt", "The", "--max-new-tokens", "-1"], "--max-new-tokens -1 must be an integer >= 1"),
        # argparse's int() printed a usage block for these, not one line
        (["--prompt", "The", "--top-k", "abc"], "--top-k abc must be an integer >= 0"),
        (["--prompt", "The", "--max-new-tokens", "2.5"], "--max-new-tokens 2.5 must be an integer >= 1"),
        (
            ["--prompt", "The", "--top-p", "1.5"],
            "error: --top-p 1.5 must be a finite number > 0 and <= 1",
        ),  # rerun NT02: blamed all three
    ],
)
def test_generate_bad_flags_are_one_line(tmp_path, args, msg, capsys):
    from megaframe.generate import main

    assert main([str(tmp_path), *args]) == 2
    assert msg in _one_error(capsys)


def test_generate_prompts_file_not_utf8_names_the_file(tmp_path, capsys):
    """K7: the message named no file."""
    from megaframe.generate import main

    (tmp_path / "p.txt").write_bytes(b"ok\n\xff\xfe\n")
    assert main([str(tmp_path), "--prompts", str(tmp_path / "p.txt")]) == 2
    assert f"--prompts {tmp_path / 'p.txt'}: not UTF-8 text" in _one_error(capsys)


@pytest.mark.parametrize(
    "setting,msg",
    [
        ("+device_memory_gb=nan", "+device_memory_gb=nan must be a finite number > 0"),  # T4
        ("+device_memory_gb=inf", "+device_memory_gb=inf must be a finite number > 0"),
        ("+device_memory_gb=0", "+device_memory_gb=0 must be a finite number > 0"),  # K3
        ("+efficiency=0", "+efficiency=0 must be a finite number > 0 and <= 1"),
        ("+efficiency=50", "+efficiency=50 must be"),
        ("+top=0", "+top=0 must be an integer >= 1"),
        ("+search=maybe", "+search=maybe must be true or false"),
        ("+plan_json=/nonexistent-folder/x.json", "+plan_json=/nonexistent-folder/x.json: not a file"),
    ],
)
def test_planner_settings_out_of_range_are_one_line_before_the_plan(setting, msg, capsys, tmp_path):
    from megaframe.plan import main

    assert main(["data=synthetic", "+world_size=4", setting]) == 2
    assert msg in _one_error(capsys)
    assert main(["data=synthetic", "+world_size=4", f"+plan_json={tmp_path}"]) == 2  # a folder
    assert "not a file in a writable folder" in _one_error(capsys)


def test_plot_into_a_missing_folder_is_one_line(tmp_path, capsys):
    """T5: FileNotFoundError from savefig, after reading every run."""
    from megaframe.plot import main

    assert main([str(tmp_path), "--out", str(tmp_path / "no" / "x.png")]) == 2
    assert "--out" in _one_error(capsys)


def test_data_verify_of_a_file_is_one_line_and_never_leaves_the_folder(tmp_path, capsys):
    """T6: NotADirectoryError traceback; S2: a `../` shard name was hashed (a read oracle on any file)."""
    from megaframe.data.verify import main

    (tmp_path / "f.txt").write_text("x")
    assert main(["verify", str(tmp_path / "f.txt")]) == 2
    assert "not a readable prepared data folder" in _one_error(capsys)
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "secret").write_bytes(b"\x00\x01" * 8)
    (data / "meta.json").write_text(
        json.dumps(
            {"vocab_size": 10, "dtype": "uint16", "shards": [{"file": "../secret", "sha256": "00" * 32}]}
        )
    )
    assert main(["verify", str(data)]) == 2
    line = _one_error(capsys)
    assert "'../secret' is not a plain name inside the folder" in line and "sha256" not in line


def test_a_tokenizer_name_in_meta_json_never_leaves_its_folder(tmp_path):
    from megaframe.inference.files import tokenizer_candidates, tokenizer_record

    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "../../etc/hostname"}))
    rec = tokenizer_record(SimpleNamespace(kind="prepared", path=str(tmp_path), blend=[]))
    assert rec is None
    found = tokenizer_candidates(tmp_path / "step_00000001", {"config": {"data": {"path": str(tmp_path)}}})
    assert found[0] == tmp_path / "tokenizer.model"  # the default name in the folder, not ../../etc/hostname


def test_a_save_past_its_limit_is_a_failed_save_not_a_hang(tmp_path, capsys):
    """Open item: a save past checkpoint.save_timeout_s ended the run with the watchdog's exit 124."""
    from megaframe.parallel.mesh import CommStats
    from megaframe.runops.watchdog import Watchdog

    tripped = []
    wd = Watchdog(5, 0, str(tmp_path), CommStats(), exit_fn=tripped.append, grace_s=0).start()
    try:
        with wd.suspended(0.3, lambda: "checkpoint step 4 not committed: ...; step_00000002 is intact"):
            time.sleep(1.5)
        assert tripped == [1]
    finally:
        wd.stop()
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == "megaframe: error: checkpoint step 4 not committed: ...; step_00000002 is intact"
    )


def test_ranks_that_find_bad_input_mid_run_end_with_the_first_ones_line(tmp_path):
    """Open item: at dp>1 only the rank reading a corrupt
    shard exited 2; its peers died in a broken collective."""
    from megaframe.runops.access.folders import peer_bad_input, record_bad_input

    assert peer_bad_input(str(tmp_path)) is None
    assert record_bad_input(str(tmp_path), "data shard a is corrupt") == "data shard a is corrupt"
    assert (
        record_bad_input(str(tmp_path), "data shard b is corrupt") == "data shard a is corrupt"
    )  # the first wins
    assert peer_bad_input(str(tmp_path)) == "data shard a is corrupt"
    claim(dirs(tmp_path, tmp_path / "ck")).release()  # a new launch starts without the old line
    assert peer_bad_input(str(tmp_path)) is None
