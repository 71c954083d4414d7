"""Nothing lost, nothing silently wrong, end to end through train.py: rollback with keep_last,
two jobs on one run.dir, a save slower than the hang limit, corrupt data, resume config checks
(SIGINT: tests/e2e/test_user_guidance_cli.py)."""

import hashlib
import json
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megaframe.checkpoint import sharded
from tests.e2e.helpers import TINY, metrics, run, start, train

pytestmark = pytest.mark.e2e

SYN = ["data=synthetic", *TINY, "train.log_interval=1", "logging.wandb.mode=disabled"]


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megaframe: error:")]
    assert len(lines) >= 1, stderr[-3000:]
    return lines[0]


def _copy_demo(src: Path, out: Path) -> Path:
    """A private copy of the prepared demo files (regular files only: the folder may hold links)."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.is_symlink():
            shutil.copy(f, out / f.name)
    return out


def _lineage(ck: Path, step: int) -> dict:
    return json.loads((ck / f"step_{step:08d}" / "metadata.json").read_text())["lineage"]


def test_rollback_with_keep_last_keeps_the_new_branch_and_auto_continues_it(tmp_path):
    ck = tmp_path / "checkpoints"
    over = SYN + ["checkpoint.keep_last=2", f"run.dir={tmp_path}"]
    first = train(over + ["train.max_steps=10", "checkpoint.interval=2"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000008", "step_00000010"]
    # a loss spike: roll back to step 8 and go another way (here: stop at 9)
    back = train(
        over + ["train.max_steps=9", "checkpoint.interval=1", f"checkpoint.resume={ck / 'step_00000008'}"]
    )
    assert back.returncode == 0, back.stderr[-2000:]
    assert (ck / "latest").read_text().strip() == "step_00000009"
    # the new branch (9) and its parent (8) are kept; the abandoned 10 is not deleted either
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000008", "step_00000009", "step_00000010"]
    assert _lineage(ck, 9)["parent"] == "step_00000008"
    again = train(over + ["train.max_steps=11", "checkpoint.interval=1"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {ck / 'step_00000009'} at step 9" in again.stdout  # not the abandoned step 10
    assert _lineage(ck, 10)["parent"] == "step_00000009" and _lineage(ck, 11)["parent"] == "step_00000010"
    assert sorted(p.name for p in sharded.committed(ck)) == ["step_00000010", "step_00000011"]
    # the abandoned branch's step 10 was renamed, not replaced, when the new branch reached step 10
    kept = list(ck.glob("step_00000010.replaced-*"))
    assert (
        len(kept) == 1
        and json.loads((kept[0] / "metadata.json").read_text())["lineage"]["parent"] == "step_00000008"
    )
    marks = [
        r
        for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        if "resumed_from" in r
    ]
    assert [(r["step"], Path(r["resumed_from"]).name) for r in marks] == [
        (9, "step_00000008"),
        (10, "step_00000009"),
    ]


def test_second_run_on_a_busy_run_dir_exits_2_and_touches_nothing(tmp_path):
    over = SYN + ["train.max_steps=100000", "checkpoint.interval=2", f"run.dir={tmp_path}"]
    first = start([sys.executable, "train.py", *over])
    try:
        t0 = time.time()
        while not (tmp_path / "checkpoints" / "latest").is_file():
            assert first.poll() is None and time.time() - t0 < 120, first.output()
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # frozen: its files must stay exactly as they are now
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        second = train(over + ["train.max_steps=3"], timeout=120)
        after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        first.send_signal(signal.SIGCONT)
    finally:
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=60)
    assert second.returncode == 2, second.stderr[-2000:]
    line = _one_error_line(second.stderr)
    assert f"run.dir={tmp_path} is in use by another run" in line and f"pid {first.pid}" in line
    assert before == after
    assert first.returncode == 0 and "stopping at step" in out, out[-2000:]
    assert not (tmp_path / "megaframe.lock").exists()  # released at the end


def test_a_save_slower_than_the_hang_limit_commits(tmp_path):
    res = train(
        SYN + ["train.max_steps=2", "checkpoint.interval=1", "train.hang_timeout_s=2", f"run.dir={tmp_path}"],
        timeout=120,
        MEGAFRAME_INJECT="slow_save:step=1:seconds=5",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (tmp_path / "checkpoints" / "step_00000001" / "metadata.json").is_file()


# SIGINT stops like SIGTERM, with a checkpoint:
# tests/e2e/test_user_guidance_cli.py::test_ctrl_c_prints_the_command_that_ continues_the_run sends it to the
# same one-process run and checks that and more (was a run of its own here)


@pytest.fixture(scope="module")
def corrupt_data(tmp_path_factory, demo_prepared):
    """A copy of the demo data whose shards hold token ids >= the vocabulary (same sizes), with meta.json's
    sha256 made to match (corruption upstream of the checksum): only the read-time range check sees it."""
    from megaframe.config import load_config
    from megaframe.data.meta_rules import sealed
    from megaframe.data.verify import first_batch_shards
    from tests.forms import build_data

    out = _copy_demo(demo_prepared, tmp_path_factory.mktemp("corrupt") / "prepared")
    cfg = load_config([*TINY, f"data.path={out}"], world_size=1)
    first = first_batch_shards(build_data(cfg), 0, cfg.train.global_batch_size, 0, cfg.train.seed)[out]
    meta = json.loads((out / "meta.json").read_text())
    for s in meta["shards"]:
        if s["file"] in first:  # start-up checks these: leave them whole, so a later read must catch it
            continue
        ids = np.fromfile(out / s["file"], dtype=meta["dtype"])
        ids[::5] = 65535
        (out / s["file"]).write_bytes(ids.tobytes())
        s["sha256"] = hashlib.sha256((out / s["file"]).read_bytes()).hexdigest()
    (out / "meta.json").write_text(json.dumps(sealed(meta)))  # the checksum of the edited fields too
    return out


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["parallel.tp=2"]), (2, [])])
def test_token_ids_outside_the_vocabulary_exit_2_naming_shard_and_offset(
    corrupt_data, tmp_path, nproc, layout
):
    res = train(
        [
            *TINY,
            f"data.path={corrupt_data}",
            "train.max_steps=50",
            "checkpoint.interval=0",
            f"run.dir={tmp_path}",
            *layout,
        ],
        nproc=nproc,
        timeout=180,
    )
    assert res.returncode == (2 if nproc == 1 else 1), res.stderr[-3000:]
    line = _one_error_line(res.stderr)
    assert "is corrupt: token id 65535 at token offset" in line and "shard_000" in line, line
    assert (
        "data: the first batch's shards match their sha256" in res.stdout
    )  # caught later, as batches are read
    if nproc > 1:
        assert "exitcode: 2" in res.stderr  # torchrun's report of the worker
        # every rank ends with the first reader's line, also at dp=2 where each rank reads its own shards;
        # torchrun SIGTERMs the peers of the first rank that exits, so some may end before they print it
        # (two ranks that each reach a corrupt shard of their own in the same step each name theirs)
        said = [ln for ln in res.stderr.splitlines() if ln.startswith("megaframe: error:")]
        assert said and all("is corrupt: token id 65535 at token offset" in ln for ln in said), res.stderr[
            -3000:
        ]
        assert "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "checkpoints").exists()


def test_data_verify_checks_sha256_and_start_up_refuses_a_corrupt_first_shard(tmp_path, demo_prepared):
    data = _copy_demo(demo_prepared, tmp_path / "prepared")
    ok = run([sys.executable, "-m", "megaframe.data", "verify", str(data)], timeout=120)
    assert ok.returncode == 0 and "every shard matches" in ok.stdout, ok.stderr
    for f in data.glob("shard_*.bin"):  # flip one byte: same size, same vocabulary, other sha256
        b = bytearray(f.read_bytes())
        b[10] ^= 1
        f.write_bytes(bytes(b))
    bad = run([sys.executable, "-m", "megaframe.data", "verify", str(data)], timeout=120)
    assert bad.returncode == 2 and "sha256" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, (
        bad.stderr
    )
    res = train([*TINY, f"data.path={data}", "train.max_steps=2", f"run.dir={tmp_path / 'run'}"], timeout=120)
    assert res.returncode == 2 and "is corrupt (sha256" in _one_error_line(res.stderr), res.stderr[-2000:]


def test_resume_refuses_a_changed_batch_seed_or_model_and_accounts_samples_with_the_override(tmp_path):
    over = SYN + ["checkpoint.interval=4", f"run.dir={tmp_path}"]
    first = train(over + ["train.max_steps=4"])
    assert first.returncode == 0, first.stderr[-2000:]
    res = train(over + ["train.max_steps=6", "train.global_batch_size=16"], timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]
    line = _one_error_line(res.stderr)
    name = "train.global_batch_size"
    assert (
        f"was written with {name}=8, this run has 16" in line and f"allow_config_change=[{name}]" in line
    ), line
    # the other guarded fields, against the same checkpoint's metadata in process (a run each costs ~8 s)
    from megaframe.checkpoint.resume_checks import check_resume
    from megaframe.config import ConfigError, load_config

    meta = json.loads((tmp_path / "checkpoints" / "step_00000004" / "metadata.json").read_text())
    for change in ["train.seed=7", "model.rope_theta=500000", "model.num_layers=3", "model.norm_eps=1e-6"]:
        with pytest.raises(ConfigError, match=f"was written with {change.split('=')[0]}="):
            check_resume(load_config(over + [change], world_size=1), meta, "ckpt", verbose=False)
    check_resume(
        load_config(over + ["parallel.tp=2"], world_size=2), meta, "ckpt", verbose=False
    )  # layouts may change
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004"]
    ok = train(
        over
        + [
            "train.max_steps=6",
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
            "checkpoint.allow_config_change=[train.global_batch_size]",
        ]
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "train.global_batch_size changed from 8 to 16" in ok.stderr
    rows = metrics(tmp_path)
    assert [(r["step"], r["consumed_samples"]) for r in rows[-2:]] == [(5, 4 * 8 + 16), (6, 4 * 8 + 32)]
    meta = json.loads((tmp_path / "checkpoints" / "step_00000006" / "metadata.json").read_text())
    assert meta["consumed_samples"] == 64 and meta["data"]["consumed_samples"] == 64


def test_a_checkpoint_that_fails_to_load_is_passed_over_by_auto_and_exits_2_when_named(tmp_path):
    """The newest checkpoint's safetensors header is garbage but its recorded size and checksum match
    (written so, or checked only by metadata): loading raises safetensors' own error. resume=auto falls back
    along the lineage; naming it explicitly exits 2 with one line (not a traceback)."""
    import zlib

    ck = tmp_path / "checkpoints"
    over = SYN + ["checkpoint.interval=3", f"run.dir={tmp_path}"]
    first = train(over + ["train.max_steps=6"])
    assert first.returncode == 0, first.stderr[-2000:]
    shard = ck / "step_00000006" / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = b"\xff" * 8  # header length: absurd
    shard.write_bytes(bytes(data))
    meta_path = ck / "step_00000006" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["shard_00000.safetensors"] = {"bytes": len(data), "crc32": zlib.crc32(bytes(data))}
    meta_path.write_text(json.dumps(meta))
    named = train(over + ["train.max_steps=7", f"checkpoint.resume={shard.parent}"], timeout=120)
    assert named.returncode == 2 and len(named.stderr.strip().splitlines()) == 1, named.stderr[-2000:]
    assert "cannot be loaded" in named.stderr and "corrupt" in named.stderr
    auto = train(over + ["train.max_steps=7"], timeout=120)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "skipping checkpoint" in auto.stderr and "corrupt" in auto.stderr
    assert f"resumed from {ck / 'step_00000003'} at step 3" in auto.stdout
