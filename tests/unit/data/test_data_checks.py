"""Bad prepared data is refused at train start, in config validation (before any process group), with
one line naming the cause: truncated or missing shards, a tokenizer that is not the shards' one, a
vocabulary larger than the model's, blended datasets of different tokenizers, eval without a split."""

from __future__ import annotations

import shutil

import pytest

from megaframe.config import ConfigError, load_config
from megaframe.data import prepare as prep
from tests.unit.data.test_prepare import paragraphs, write_text_corpus


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    src = write_text_corpus(root / "src", paragraphs(40))
    for name, vocab in (("a", 400), ("b", 380)):
        cfg = load_config(
            [
                f"data.source={src}",
                f"data.path={root / name}",
                f"data.vocab_size={vocab}",
                "data.num_workers=1",
            ],
            world_size=1,
            check_data=False,
        )
        prep.prepare(cfg, chunk_chars=500)  # several shards
    return root


@pytest.fixture()
def copy(good, tmp_path):
    def make(name="a"):
        dst = tmp_path / name
        shutil.copytree(good / name, dst)
        return dst

    return make


def error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["data=demo", "model.vocab_size=512", *overrides], world_size=1)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_good_data_passes(good):
    cfg = load_config(["data=demo", f"data.path={good / 'a'}", "model.vocab_size=512"], world_size=1)
    assert cfg.data.path == str(good / "a")


def test_truncated_shard(copy):
    path = copy()
    shard = sorted(path.glob("shard_*.bin"))[1]
    shard.write_bytes(shard.read_bytes()[:-2])
    msg = error(f"data.path={path}")
    assert msg.startswith(f"data.path={path}: shard {shard.name}") and "truncated" in msg


def test_missing_shard_and_document_index(copy):
    path = copy()
    sorted(path.glob("shard_*.docs.npy"))[0].unlink()
    assert "document index" in error(f"data.path={path}")
    sorted(path.glob("shard_*.bin"))[-1].unlink()
    assert "missing" in error(f"data.path={path}")


def test_tokenizer_that_is_not_the_shards_one(copy, good):
    path = copy()
    shutil.copyfile(good / "b" / "tokenizer.model", path / "tokenizer.model")
    assert "tokenizer.model does not match the tokenizer the shards were made with" in error(
        f"data.path={path}"
    )


def test_vocab_larger_than_the_model(good):
    assert "model.vocab_size=256 is smaller than the tokenizer vocabulary" in error(
        f"data.path={good / 'a'}", "model.vocab_size=256"
    )


def test_blend_checks(good, copy):
    a, b = good / "a", good / "b"
    ok = load_config(
        [
            "data=demo",
            f"data.blend=[{{path: {a}, weight: 2}}, {{path: {copy()}, weight: 1}}]",
            "model.vocab_size=512",
        ],
        world_size=1,
    )
    assert len(ok.data.blend) == 2
    assert "different tokenizers" in error(f"data.blend=[{{path: {a}, weight: 2}}, {{path: {b}, weight: 1}}]")
    assert "data.blend[1]" in error(f"data.blend=[{{path: {a}, weight: 2}}, {{path: {b}, weight: 0}}]")
    assert error(f"data.blend=[{{path: {a}}}, {{path: {b / 'nope'}}}]").startswith("data.blend[1].path=")
    assert "wieght" in error(f"data.blend=[{{path: {a}, wieght: 2}}]")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["train.eval_interval=10"], "data.valid_fraction"),
        (["data.valid_fraction=1.0"], "data.valid_fraction"),
        (["data.num_workers=-1"], "data.num_workers"),
        (["train.eval_iters=0", "train.eval_interval=5", "data.valid_fraction=0.1"], "train.eval_iters"),
    ],
)
def test_field_checks(good, overrides, needle):
    assert needle in error(f"data.path={good / 'a'}", *overrides)
