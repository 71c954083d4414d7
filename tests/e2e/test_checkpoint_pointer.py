"""A folder where a save writes its `latest` pointer (`latest`, or the `latest.tmp` it renames) is refused at
start-up with one line and exit 2, before any step: a save used to end the run with a traceback after it
had trained and written its step folder."""

import pytest

from tests.e2e.helpers import TINY, train

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", ["latest", "latest.tmp"])
def test_a_folder_in_place_of_the_latest_pointer_is_refused_before_any_step(tmp_path, name):
    ck = tmp_path / "ck"
    (ck / name).mkdir(parents=True)
    res = train(
        [
            "data=synthetic",
            *TINY,
            "train.max_steps=1",
            "checkpoint.interval=1",
            "logging.wandb.mode=disabled",
            f"run.dir={tmp_path / 'run'}",
            f"checkpoint.dir={ck}",
        ],
        timeout=180,
    )
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("megaframe: error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    line = (
        f"megaframe: error: checkpoint.dir={ck}: {ck / name} is a folder, not the `{name}` pointer file "
        "a save writes; move it away (or pick another checkpoint.dir)"
    )
    assert errors == [line], res.stderr[-2000:]
    assert sorted(p.name for p in ck.iterdir()) == [name]  # no step folder, no lock left
