"""Two `prepare` processes of one output at the same time never publish a folder that lacks data: a plain
run beside a task (either way round) leaves one of them refused with one line naming the other; two tasks
of different splits that own the same unit (task 1 of 2 and task 2 of 4) take turns on it. Real processes
on a real corpus; the published folder must pass `python -m megaframe.data verify` and hold every token a
lone run writes. Also: the output inside the source folder is not read back as input, and a folder whose
meta.json names a missing or short shard is not published."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megaframe.data.prepare import partial
from megaframe.data.prepare.sources import PrepareError
from tests.e2e.helpers import run
from tests.unit.data.test_prepare import paragraphs, run_main

# prepare with many small shards in one unit, each taking 0.25 s (a slow tokenizer, a large corpus), a
# second process started once the first shard exists finding the first mid-unit: prepare_slow_shards.py
DRIVER = str(Path(__file__).with_name("prepare_slow_shards.py"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~100 KB of paragraphs in three files (one unit), and a lone run's output with a trained tokenizer."""
    root = tmp_path_factory.mktemp("concurrent")
    src = root / "src"
    src.mkdir()
    paras = paragraphs(40)
    for i in range(3):
        (src / f"part{i}.txt").write_text("\n\n".join(paras[(i + k) % 40] for k in range(400)) + "\n")
    ref = root / "ref"
    res = run(
        [
            sys.executable,
            "-m",
            "megaframe.data.prepare",
            f"data.source={src}",
            f"data.path={ref}",
            "data.vocab_size=400",
            "data.num_workers=1",
            "data.split=paragraph",
        ],
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return src, ref


def start(corpus, out, mode: str, after=None):
    """prepare through DRIVER in its own process (a fork of the warm interpreter), to its end."""
    src, ref = corpus
    args = [
        f"data.source={src}",
        f"data.path={out}",
        f"data.tokenizer={ref / 'tokenizer.model'}",
        "data.num_workers=1",
        "data.split=paragraph",
    ]
    if mode != "plain":
        task, n = mode.split("/")
        args += [f"data.task={task}", f"data.num_tasks={n}"]
    wait = {} if after is None else {"START_AFTER": str(after)}
    return run([sys.executable, DRIVER, *args], timeout=300, **wait)


def race(corpus, out, first: str, second: str):
    """`second` begins once `first` has written its first shard; returns both (rc, stdout, stderr)."""
    shard = out.parent / f".{out.name}.partial" / "shard_00000_00000.bin"
    with ThreadPoolExecutor(2) as pool:  # both processes at once
        a = pool.submit(start, corpus, out, first)
        b = pool.submit(start, corpus, out, second, shard)
        return [(r.returncode, r.stdout, r.stderr) for r in (a.result(), b.result())]


def assert_complete(corpus, out):
    res = run([sys.executable, "-m", "megaframe.data", "verify", str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got, ref = (json.loads((d / "meta.json").read_text()) for d in (out, corpus[1]))
    assert (got["num_tokens"], got["num_documents"]) == (ref["num_tokens"], ref["num_documents"])
    assert len(got["shards"]) > 4, "too few shards for the second process to start mid-unit"
    assert not list(out.parent.glob(f".{out.name}.partial*")), "the partial folder outlived the publish"


@pytest.mark.parametrize("first,second", [("plain", "1/2"), ("1/2", "plain")])
def test_a_plain_run_and_a_task_of_one_output_never_both_write(corpus, tmp_path, first, second):
    out = tmp_path / "out"
    (rc_a, _, err_a), (rc_b, _, err_b) = race(corpus, out, first, second)
    assert rc_a == 0, err_a
    assert_complete(corpus, out)  # the one unit belongs to task 1 of 2: it alone completes the set
    assert rc_b == 2 and "being prepared by another process" in err_b and "pid" in err_b, err_b
    assert len(err_b.strip().splitlines()) == 1 and "Traceback" not in err_b


def test_tasks_of_two_splits_owning_one_unit_take_turns(corpus, tmp_path):
    """With one unit, task 1 of 2 and task 2 of 4 each own all of it: the second waits for the unit, finds
    it recorded, and one of the two publishes."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    results = race(corpus, out, "1/2", "2/4")
    assert_complete(corpus, out)
    for rc, _, err in results:
        assert rc == 0 and "Traceback" not in err, err
    said = " ".join(o for _, o, _ in results)
    assert "prepared" in said and ("merged by another" in said or "already prepared" in said), said
    assert time.monotonic() - t0 < 120


def test_the_output_inside_the_source_is_not_read_as_input(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(paragraphs(30)) + "\n")
    args = (
        f"data.source={src}",
        f"data.path={src / 'prepared'}",
        "data.vocab_size=400",
        "data.num_workers=1",
    )
    rc, _, err = run_main(capsys, *args)
    assert rc == 0, err
    before = (src / "prepared" / "meta.json").read_bytes()
    rc, out, err = run_main(capsys, *args)  # an identical re-run does nothing
    assert rc == 0 and "nothing to do" in out, err
    assert (src / "prepared" / "meta.json").read_bytes() == before
    assert json.loads(before)["skipped"] == {}, "its own files counted as skipped input"


def test_a_shard_missing_or_short_is_never_published(tmp_path):
    shard = {"file": "shard_00000_00000.bin", "docs": "shard_00000_00000.docs.npy", "num_tokens": 4}
    meta = {"dtype": "uint16", "shards": [shard]}
    (tmp_path / "shard_00000_00000.docs.npy").write_bytes(b"x")
    with pytest.raises(PrepareError, match="shard_00000_00000.bin named in meta.json is missing"):
        partial.check_shards(tmp_path, meta)
    (tmp_path / "shard_00000_00000.bin").write_bytes(b"\0" * 6)
    with pytest.raises(PrepareError, match="holds 6 bytes, not the 8"):
        partial.check_shards(tmp_path, meta)
    (tmp_path / "shard_00000_00000.bin").write_bytes(b"\0" * 8)
    partial.check_shards(tmp_path, meta)
