"""A dataset is one stream whatever its spelling, every file a reader trusts carries a checksum, and a stage's
end is a real step: one folder under two spellings is one stream (and refused twice in one blend), a damaged
document index is refused by `data verify` and by the reader, naming the file (folders prepared before the
index had a checksum still load), non-object shard entries and stage ends <= 0, nan or inf are one-line
errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from megaframe.config import ConfigError, load_config
from megaframe.data import prepare as prep
from megaframe.data import verify
from megaframe.data.dataset import PreparedData, build_data
from tests.unit.data.test_prepare import paragraphs, write_text_corpus
from tests.unit.data.test_run_record import blend, stages

TINY = ["model.seq_length=8", "train.global_batch_size=8", "train.micro_batch_size=2", "model.vocab_size=512"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    src = write_text_corpus(root / "src", paragraphs(40))
    cfg = load_config(
        [
            f"data.source={src}",
            f"data.path={root / 'a'}",
            "data.vocab_size=400",
            "data.num_workers=1",
            "data.split=paragraph",
        ],
        world_size=1,
        check_data=False,
    )
    prep.prepare(cfg, chunk_chars=500)  # several shards, each with a document index
    return root / "a"


def run_cfg(*overrides: str, check_data: bool = False):
    return load_config(["data=demo", *TINY, *overrides], world_size=1, check_data=check_data)


def test_one_folder_under_two_spellings_is_one_stream(prepared, tmp_path, monkeypatch):
    (tmp_path / "link").symlink_to(prepared)
    monkeypatch.chdir(prepared.parent)
    for spelling in (f"{prepared}/", tmp_path / "link", f"./{prepared.name}"):
        data = build_data(run_cfg(stages([(prepared, 1)], [(spelling, 1)])))
        assert len(data.parts) == 1  # one dataset: stage 1 goes on where stage 0 left it
        own = [data.locate(g)[1] for g in range(40)]
        assert own == list(range(40)), spelling
    with pytest.raises(ConfigError, match=r"data.blend\[1\].path=.* is the folder of data.blend\[0\].path"):
        run_cfg(f"data.blend={blend((prepared, 1), (f'{prepared}/', 1))}")
    with pytest.raises(ConfigError, match=r"data.stages\[0\].blend\[1\].path=.* is the folder of"):
        run_cfg(stages([(prepared, 1), (tmp_path / "link", 1)], [(prepared, 1)]))


def damaged_index(prepared, tmp_path, value: int, keep_sha: bool = True):
    path = tmp_path / "bad"
    shutil.copytree(prepared, path)
    meta = json.loads((path / "meta.json").read_text())
    entry = meta["shards"][1]
    if not keep_sha:  # as prepared before document indexes had a checksum
        for s in meta["shards"]:
            s.pop("docs_sha256", None)
        (path / "meta.json").write_text(json.dumps(meta))
    starts = np.load(path / entry["docs"])
    starts[len(starts) // 2] = value
    np.save(path / entry["docs"], starts)
    return path, entry["docs"]


def verify_cli(path, capsys) -> tuple[int, str, str]:
    rc = verify.main(["verify", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_damaged_document_index_is_refused_by_verify_and_the_reader(prepared, tmp_path, capsys):
    assert all(s.get("docs_sha256") for s in json.loads((prepared / "meta.json").read_text())["shards"])
    rc, out, _ = verify_cli(prepared, capsys)
    assert rc == 0 and "no sha256" not in out
    path, docs = damaged_index(prepared, tmp_path, 10**12)
    rc, _, err = verify_cli(path, capsys)
    assert rc == 2 and f"document index {path / docs} is corrupt (sha256" in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=f"document index {path / docs} is corrupt"):
        PreparedData(path, 8, "train", 0.1)  # the split would have moved: 58 % of the tokens held out
    assert PreparedData(path, 8, "all").num_samples > 0  # without a split the index is not read


@pytest.mark.parametrize("value", [10**12, -5, 0])
def test_an_index_without_a_checksum_loads_and_is_checked_for_order_and_range(
    prepared, tmp_path, capsys, value
):
    path, docs = damaged_index(prepared, tmp_path, value, keep_sha=False)
    rc, _, err = verify_cli(path, capsys)
    assert rc == 2 and f"document index {path / docs} is corrupt:" in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=f"document index {path / docs} is corrupt"):
        PreparedData(path, 8, "valid", 0.1)
    shutil.rmtree(path)
    path, _ = damaged_index(prepared, tmp_path, 1, keep_sha=False)
    np.save(path / docs, np.load(prepared / docs))  # the good index back: loads, verify says it is unchecked
    rc, out, _ = verify_cli(path, capsys)
    assert rc == 0 and "have no sha256 in meta.json" in out
    assert PreparedData(path, 8, "valid", 0.1).num_samples > 0


def test_shard_entries_that_are_not_objects_are_one_line(prepared, tmp_path, capsys):
    path = tmp_path / "strings"
    shutil.copytree(prepared, path)
    meta = json.loads((path / "meta.json").read_text())
    meta["shards"] = [s["file"] for s in meta["shards"]]
    (path / "meta.json").write_text(json.dumps(meta))
    rc, _, err = verify_cli(path, capsys)
    assert rc == 2 and "shards[0]" in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match=r"data.path=.*shards\[0\]"):
        run_cfg(f"data.path={path}", check_data=True)  # training's start-up check


@pytest.mark.parametrize(
    "end",
    [
        "until_step: -3",
        "until_step: 0",
        "until_tokens: 0",
        "until_tokens: nan",
        "until_tokens: inf",
        "until_tokens: -inf",
    ],
)
def test_a_stage_end_must_be_at_least_one_and_finite(prepared, end):
    with pytest.raises(ConfigError, match=r"data.stages\[0\].until_(step|tokens)=\S+ must be (>= 1|finite)$"):
        run_cfg(stages([(prepared, 1)], [(prepared, 1)]).replace("until_step: 2", end))
