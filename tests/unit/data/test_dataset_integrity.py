"""A dataset is one stream whatever its spelling, every file a reader trusts carries a checksum, and a stage's
end is a real step: one folder under two spellings is one stream (and refused twice in one blend), a damaged
document index is refused by `data verify` and by the reader, naming the file (folders prepared before the
index had a checksum still load), an edited meta.json (dtype, vocabulary, counts, shard list, a removed
sha256) is refused by its checksum, or by its fields' rules where it has none, non-object shard entries
and stage ends <= 0, nan or inf are one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from megaframe.config import ConfigError, load_config
from megaframe.data import prepare as prep
from megaframe.data import verify
from megaframe.data.dataset import PreparedData
from tests.forms import build_data
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
    if not keep_sha:  # as prepared before document indexes (and meta.json) had a checksum
        meta.pop("meta_sha256")
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


def _swap_first_two(meta):
    meta["shards"][:2] = meta["shards"][1::-1]


def _one_more_document(meta):  # the totals agree: only the shard's document index can tell
    meta["shards"][1]["num_docs"] += 1
    meta["num_documents"] += 1


def _renamed(path):
    def edit(meta):
        entry = meta["shards"][0]
        (path / entry["file"]).rename(path / "shard_00000_00000x.bin")
        entry["file"] = "shard_00000_00000x.bin"

    return edit


# Each edit changes how a reader reads the tokens (or what it trusts about them) and leaves the shard bytes
# alone, so the shards' own sha256s cannot see it; (name, edit, words of the refusal when meta.json carries
# no checksum, as prepared before it was recorded; None: only `data verify` can tell, from the tokenizer).
META_EDITS = [
    ("dtype float16", lambda m: m.update(dtype="float16"), "dtype 'float16' is not how prepare writes"),
    ("dtype uint32", lambda m: m.update(dtype="uint32"), "dtype 'uint32' is not how prepare writes"),
    ("vocab_size", lambda m: m.update(vocab_size=m["vocab_size"] + 100), None),
    ("num_tokens", lambda m: m.update(num_tokens=m["num_tokens"] + 1), "num_tokens"),
    ("shards reordered", _swap_first_two, "does not come after shards[0]"),
    ("shard sha256 removed", lambda m: m["shards"][0].pop("sha256"), "records no sha256"),
    ("index sha256 removed", lambda m: m["shards"][0].pop("docs_sha256"), "no checksum"),
    ("num_docs", _one_more_document, "meta.json says the shard holds"),
]


def edited_meta(prepared, tmp_path, edit, legacy: bool = False):
    """A copy of `prepared` whose meta.json got `edit` (legacy: and lost its checksum, as older folders)."""
    path = tmp_path / "edited"
    shutil.copytree(prepared, path)
    meta = json.loads((path / "meta.json").read_text())
    edit = edit(path) if edit is _renamed else edit
    edit(meta)
    if legacy:
        meta.pop("meta_sha256")
    (path / "meta.json").write_text(json.dumps(meta, indent=1))
    return path


@pytest.mark.parametrize("name,edit", [(n, e) for n, e, _ in META_EDITS] + [("renamed", _renamed)])
def test_an_edited_meta_json_is_refused_by_verify_and_training(prepared, tmp_path, capsys, name, edit):
    path = edited_meta(prepared, tmp_path, edit)
    rc, out, err = verify_cli(path, capsys)
    assert rc == 2 and "does not match its meta_sha256" in err and err.count("\n") == 1, (out, err)
    with pytest.raises(ConfigError, match=f"data.path={path}: meta.json is corrupt: its content does not"):
        run_cfg(f"data.path={path}", check_data=True)  # training's start-up check: no shard hashed
    with pytest.raises(ValueError, match="meta_sha256"):
        PreparedData(path, 8)


@pytest.mark.parametrize("name,edit,words", [e for e in META_EDITS if e[2] not in (None, "no checksum")])
def test_without_a_checksum_the_fields_are_held_to_their_rules(prepared, tmp_path, capsys, name, edit, words):
    path = edited_meta(prepared, tmp_path, edit, legacy=True)
    rc, _, err = verify_cli(path, capsys)
    assert rc == 2 and words in err and err.count("\n") == 1, err
    with pytest.raises((ValueError, ConfigError), match=words.replace("[", r"\[")):
        run_cfg(f"data.path={path}", check_data=True)
        PreparedData(path, 8, "train", 0.1)  # the document index is read for the split


def test_an_edited_vocabulary_without_a_checksum_is_caught_by_its_tokenizer(prepared, tmp_path, capsys):
    path = edited_meta(prepared, tmp_path, META_EDITS[2][1], legacy=True)
    rc, _, err = verify_cli(path, capsys)
    assert rc == 2 and "meta.json says vocab_size" in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="meta.json says vocab_size"):
        run_cfg(f"data.path={path}", check_data=True)  # a sentencepiece model loads in milliseconds


def test_data_verify_says_what_had_no_checksum_to_match(prepared, tmp_path, capsys):
    rc, out, _ = verify_cli(prepared, capsys)
    assert rc == 0 and "every shard matches its sha256" in out and "meta.json matches its checksum" in out
    older = edited_meta(prepared, tmp_path, lambda m: None, legacy=True)  # prepared before the checksum
    rc, out, _ = verify_cli(older, capsys)
    assert rc == 0 and "meta.json has no checksum" in out, out
    assert PreparedData(older, 8, "valid", 0.1).num_samples > 0  # and it loads
    v1 = tmp_path / "v1"  # the first format recorded no shard sha256: said, never "every shard matches"
    shutil.copytree(older, v1)
    meta = json.loads((v1 / "meta.json").read_text())
    meta["format"] = "megaframe-tokens-v1"
    for s in meta["shards"]:
        s.pop("sha256")
    (v1 / "meta.json").write_text(json.dumps(meta))
    rc, out, _ = verify_cli(v1, capsys)
    assert rc == 0 and f"{len(meta['shards'])} shard(s) have no sha256" in out, out
    assert "every shard matches" not in out
