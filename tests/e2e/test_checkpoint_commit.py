"""A checkpoint is committed only when every rank wrote its part: a failed or killed writer leaves the
previous checkpoint and `latest` as they were, and resume=auto continues from there with the losses of
an uninterrupted run."""

from __future__ import annotations

import pytest

from megaframe.checkpoint import sharded
from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e

OVER = ["data=synthetic", *TINY, "train.max_steps=6", "train.log_interval=1", "checkpoint.interval=2"]
_REF: dict = {}


def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run's losses, once per module. One process: the losses do not depend on the dp
    layout (within 1e-5, as test_fault_tolerance's torchrun restart test also relies on), and one process
    starts without torchrun's agent and a second rank."""
    if not _REF:
        d = tmp_path_factory.mktemp("ref")
        res = train(OVER + [f"run.dir={d}"])
        assert res.returncode == 0, res.stderr[-2000:]
        _REF["rows"] = metrics(d)
    return _REF["rows"]


def assert_same_losses(got: list[dict], want: list[dict]) -> None:
    by_step = {r["step"]: r["loss"] for r in want}
    for r in got:
        assert abs(r["loss"] - by_step[r["step"]]) <= 1e-5 * abs(by_step[r["step"]]), (r, by_step[r["step"]])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_write_on_one_rank_stops_without_commit_then_resume_continues(
    tmp_path, tmp_path_factory, mode
):
    over = OVER + [
        f"run.dir={tmp_path}",
        "checkpoint.keep_last=1",
        f"checkpoint.async={str(mode == 'async').lower()}",
    ]
    # ranks started as srun does (no torchrun agent): the commit protocol is the subject, not the launcher
    bad = train(over, nproc=2, launcher="env", MEGAFRAME_INJECT="savefail:rank=1:step=4")
    assert bad.returncode == 1, bad.stderr[-3000:]
    assert (
        "checkpoint step 4 not committed" in bad.stderr and "injected write failure on rank 1" in bad.stderr
    )
    ck = tmp_path / "checkpoints"
    assert [p.name for p in sharded.committed(ck)] == ["step_00000002"]  # keep_last=1 pruned nothing good
    assert (ck / "latest").read_text().strip() == "step_00000002" and not list(ck.glob("*.tmp"))
    sharded.verify(ck / "step_00000002")
    again = train(over, nproc=2, launcher="env")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "step_00000002" in again.stdout
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert_same_losses(rows, reference(tmp_path_factory))
    # accounting: the resumed run logs what its logging rank read, and later what it wrote
    assert rows[2]["ckpt/read_bytes"] > 0 and rows[2]["ckpt/load_s"] >= 0
    assert rows[-1]["ckpt/write_bytes"] > 0 and rows[-1]["ckpt/save_s"] > 0


def test_sigkill_during_an_async_write_restarts_from_the_previous_checkpoint(tmp_path, tmp_path_factory):
    """Rank 1 is SIGKILLed in the middle of writing step 4 (its background thread): the group ends with
    step 4 never committed, and the group started again (as torchrun's --max-restarts does: the same
    command, test_fault_tolerance's torchrun restart test covers the agent) resumes from step 2 and ends
    with the reference losses. Ranks started as srun does: the commit protocol is the subject."""
    over = OVER + ["checkpoint.async=true", f"run.dir={tmp_path}"]
    killed = train(over, nproc=2, launcher="env", MEGAFRAME_INJECT="savekill:rank=1:step=4")
    assert killed.returncode != 0, killed.stderr[-3000:]
    ck = tmp_path / "checkpoints"
    assert [p.name for p in sharded.committed(ck)] == ["step_00000002"]
    assert (ck / "latest").read_text().strip() == "step_00000002"
    # the restart: a fault strikes a group's first attempt only, so the restarted group runs without it
    res = train(over, nproc=2, launcher="env")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "resumed from" in out and "step_00000002" in out
    assert [p.name for p in sharded.committed(ck)] == ["step_00000002", "step_00000004", "step_00000006"]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert_same_losses(rows, reference(tmp_path_factory))
    for p in sharded.committed(ck):
        sharded.verify(p)
