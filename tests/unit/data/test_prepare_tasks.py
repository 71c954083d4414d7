"""prepare as N tasks (data.task / data.num_tasks): 4 tasks as 4 plain processes give the one-task output
(same num_documents, num_tokens, shard files byte for byte); a merge with a missing part exits 2 naming it;
a killed task re-run completes the set; a re-run of a finished part does nothing."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megaframe.data.prepare.tasks import unit_tasks
from tests.e2e.helpers import run
from tests.e2e.stdlib_corpus import write_corpus

ARGS = ["data.vocab_size=512", "data.num_workers=1"]
UNIT = str(Path(__file__).with_name("prepare_small_units.py"))


def prep(*args, timeout=300):
    """prepare in its own process (a fork of the warm interpreter), with small units (64 KB) so a small
    corpus has several per task."""
    return run([sys.executable, UNIT, *args], timeout=timeout)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    src = write_corpus(root / "src")
    one = root / "one"
    res = prep(f"data.source={src}", f"data.path={one}", *ARGS)
    assert res.returncode == 0, res.stderr
    return src, one


def test_units_split_into_contiguous_ranges_balanced_by_bytes():
    assert unit_tasks([10] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert unit_tasks([70, 10, 10, 10], 2) == [0, 1, 1, 1]
    assert unit_tasks([5], 4) == [2]  # more tasks than units: the others have nothing to do


def test_four_tasks_equal_one_task(corpus, tmp_path):
    src, one = corpus
    out = tmp_path / "four"
    common = [f"data.source={src}", f"data.path={out}", *ARGS, "data.num_tasks=4"]
    with ThreadPoolExecutor(4) as pool:  # the four tasks at once, each its own process
        results = list(pool.map(lambda i: prep(*common, f"data.task={i}"), range(4)))
    for res in results:
        assert res.returncode == 0, res.stderr
    a, b = (json.loads((d / "meta.json").read_text()) for d in (one, out))
    assert (a["num_documents"], a["num_tokens"]) == (b["num_documents"], b["num_tokens"])
    assert [s["file"] for s in a["shards"]] == [s["file"] for s in b["shards"]] and len(a["shards"]) >= 4
    for s in a["shards"]:
        assert (one / s["file"]).read_bytes() == (out / s["file"]).read_bytes()
    assert not list(out.glob(".*lock*"))
    again = prep(*common, "data.task=2")  # a finished set: nothing to do
    assert again.returncode == 0 and "already prepared" in again.stdout


def test_a_missing_part_is_named_and_a_rerun_completes_the_set(corpus, tmp_path):
    src, one = corpus
    out = tmp_path / "parts"
    common = [f"data.source={src}", f"data.path={out}", *ARGS, "data.num_tasks=3"]
    for i in (0, 2):  # task 1 never ran (killed before it started)
        res = prep(*common, f"data.task={i}")
        assert res.returncode == 0 and "done;" in res.stdout, res.stderr
        # what this task itself tokenizes (before: every task printed the whole corpus's file count)
        own = [ln for ln in res.stdout.splitlines() if ln.startswith(f"megaframe: prepare: task {i} of 3: ")]
        assert len(own) == 1 and ("tokenizing" in own[0]) != ("nothing to tokenize" in own[0]), res.stdout
    merge = prep("merge", *common)
    assert merge.returncode == 2 and "tasks 1" in merge.stderr and "\n" not in merge.stderr.strip()
    assert "tokenizing" not in merge.stdout, merge.stdout  # a merge tokenizes nothing
    assert not (out / "meta.json").exists()
    res = prep(*common, "data.task=1")
    assert res.returncode == 0, res.stderr
    assert (
        json.loads((out / "meta.json").read_text())["num_tokens"]
        == json.loads((one / "meta.json").read_text())["num_tokens"]
    )
