"""checkpoint.interval_minutes: a timed save is decided together, at the stop-check steps only.

Rank 1's clock alone says "due" (ranks' clocks differ): the flag rides on the stop check's one all-reduce,
so every rank saves at the same check step (a save is collective: a rank going alone would hang) and the
steps between check steps gain no host sync and no collective over the whole job.
"""

from unittest import mock

import pytest

from tests.distributed.sync_count import syncs_per_step

pytestmark = pytest.mark.distributed

STEPS = 6
OVER = ["checkpoint.interval_minutes=0.0001", "train.signal_check_interval=3", "data=synthetic"]


def _rank1_clock_only(mesh, over, steps, run_dir):
    from megaframe.training.checkpointing import Checkpointer

    with mock.patch.object(Checkpointer, "overdue", lambda self: self.mesh.rank == 1):
        return syncs_per_step(mesh, over, steps, run_dir)


def test_timed_save_is_agreed_at_check_steps_with_no_sync_between(pool, tmp_path):
    counts = pool.run(_rank1_clock_only, 2, OVER, STEPS, str(tmp_path))[0]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    # check steps: the first (1), every 3rd (3, 6) and the last (6); nothing in between
    assert saved == ["step_00000001", "step_00000003", "step_00000006"], saved
    for s in (2, 4, 5):
        assert not counts[s]["syncs"] and not counts[s]["world"], (s, counts[s])
