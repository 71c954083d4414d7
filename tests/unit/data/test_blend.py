"""data.blend: the Megatron-style blended index is deterministic, layout-free and hits its weights; the
validation split is a seeded random sample of whole documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megaframe.config import load_config
from megaframe.data.dataset import PreparedData
from megaframe.data.kinds import data_state
from megaframe.data.mixture import BlendedData, blend_pattern
from tests.forms import build_data, microbatches
from tests.unit.data.test_data_order import write_prepared

SEQ = 8


def dataset(folder, base: int, num_tokens: int, doc_len: int = 50):
    """Tokens base + position; a document index of documents of doc_len tokens per shard."""
    tokens = base + np.arange(num_tokens)
    path = write_prepared(folder, np.array_split(tokens, 3))
    meta = json.loads((path / "meta.json").read_text())
    for k, s in enumerate(meta["shards"]):
        np.save(path / f"docs_{k}.npy", np.arange(0, s["num_tokens"], doc_len, dtype=np.int64))
        s["docs"] = f"docs_{k}.npy"
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture()
def two(tmp_path):
    return dataset(tmp_path / "a", 0, 4000), dataset(tmp_path / "b", 30000, 1500)


def test_pattern_keeps_every_prefix_within_one_sample_of_the_weights():
    which, rank, counts = blend_pattern([0.7, 0.3], block=1000)
    seen = np.cumsum(np.stack([which == 0, which == 1]), axis=1)
    target = np.outer([0.7, 0.3], np.arange(1, 1001))
    assert np.abs(seen - target).max() <= 1.0
    assert counts.tolist() == [700, 300]
    assert rank[which == 1].tolist() == list(range(300))  # each dataset walks its own positions in order
    assert blend_pattern([7, 3], block=1000)[0].tolist() == which.tolist()  # weights are normalized


def test_blend_of_07_03_samples_within_one_percent(two):
    a, b = (PreparedData(p, SEQ) for p in two)
    data = BlendedData([a, b], [0.7, 0.3], seed=3)
    from_a = n = 0
    for step in range(100):  # 1600 samples: b (187 samples) is reused over several epochs
        x, _ = torch.cat([m[0] for m in microbatches(data, step, 16, 8, 0, 1, 3)]), None
        from_a += int((x[:, 0] < 30000).sum())
        n += x.shape[0]
    assert abs(from_a / n - 0.7) < 0.01, from_a / n
    # every sample is whole: consecutive tokens of one dataset
    for g in range(50):
        s = data[g]
        assert np.array_equal(s - s[0], np.arange(SEQ + 1))


@pytest.mark.parametrize("dp,micro", [(1, 2), (2, 4), (4, 1)])
def test_blended_global_batch_is_layout_free(two, dp, micro):
    data = BlendedData([PreparedData(p, SEQ) for p in two], [0.7, 0.3], seed=3)

    def batch(dp, micro):
        return torch.cat([x for r in range(dp) for x, _ in microbatches(data, 5, 16, micro, r, dp, 3)])

    assert torch.equal(batch(dp, micro), batch(1, 16))


def test_blended_datasets_are_each_shuffled_per_epoch(two):
    data = BlendedData([PreparedData(p, SEQ) for p in two], [0.5, 0.5], seed=3)
    n = data.parts[1].num_samples
    assert n == (1500 - 1) // SEQ
    starts = [int(data[g][0]) for g in range(2 * n) if data.locate(g)[0] == 1]
    first = [(s - 30000) // SEQ for s in starts]
    assert sorted(first) == list(range(n)) and first != list(range(n))


def test_validation_split_is_a_seeded_random_sample_of_whole_documents(tmp_path):
    # before: the last ~10 % of tokens (one tail of the corpus: the last books, the last files)
    path = dataset(tmp_path / "a", 0, 4000, doc_len=50)
    train = PreparedData(path, SEQ, "train", 0.1)
    valid = PreparedData(path, SEQ, "valid", 0.1)
    assert 400 <= valid.num_tokens < 450 and train.num_tokens + valid.num_tokens == 4000
    starts = PreparedData(path, SEQ).document_starts()
    ends = np.append(starts[1:], 4000)
    held = [(a, b) for a, b in zip(starts, ends) if any(s <= a and b <= e for s, e in valid.segments)]
    assert sum(b - a for a, b in held) == valid.num_tokens  # whole documents only
    assert len(valid.segments) > 1  # documents from all over the corpus, not one tail
    tokens = lambda d: {int(t) for i in range(d.num_samples) for t in d[i]}  # noqa: E731 (tokens = positions)
    assert not tokens(train) & {
        t for a, b in held for t in range(a, b)
    }  # training never reads held-out tokens
    again = PreparedData(path, SEQ, "valid", 0.1)
    assert np.array_equal(again.segments, valid.segments)  # seeded: the same documents every time
    full = PreparedData(path, SEQ)
    assert full.num_samples == (4000 - 1) // SEQ and np.array_equal(full[3], np.arange(24, 33))
    assert PreparedData(path, SEQ, "valid", 0.0005).num_tokens in (50, 34, 33)  # at least one document
    plain = write_prepared(tmp_path / "plain", [np.arange(4000)])  # no document index: the tail
    assert PreparedData(plain, SEQ, "valid", 0.1)[0][0] == 3600
    with pytest.raises(ValueError, match="validation split"):
        PreparedData(plain, SEQ, "valid", 0.001)


def test_build_data_from_a_command_line_blend(two):
    a, b = two
    cfg = load_config(
        [
            "data=demo",
            f"data.blend=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]",
            "data.valid_fraction=0.1",
            "model.seq_length=8",
        ],
        world_size=1,
        check_data=False,
    )
    assert [(x.path, x.weight) for x in cfg.data.blend] == [(str(a), 0.7), (str(b), 0.3)]
    train, valid = build_data(cfg), build_data(cfg, split="valid")
    assert isinstance(train, BlendedData) and train.weights == pytest.approx([0.7, 0.3])
    assert [p.num_tokens for p in valid.parts] == [PreparedData(x, 8, "valid", 0.1).num_tokens for x in two]
    state = data_state(cfg.data, 10, cfg.train.seed, cfg.train.global_batch_size)
    assert state["consumed_samples"] == 10 * cfg.train.global_batch_size and len(state["blend"]) == 2


def _staged(paths, until=(3, 6)):
    from megaframe.config.schema import BlendSource, DataStage

    a, b, c = (str(p) for p in paths)
    return [
        DataStage(until_step=until[0], blend=[BlendSource(a, 1.0)]),
        DataStage(until_step=until[1], blend=[BlendSource(a, 0.5), BlendSource(c, 0.5)]),
        DataStage(blend=[BlendSource(b, 0.7), BlendSource(c, 0.3)]),
    ]


def test_stages_switch_exactly_at_their_steps_under_any_dp(tmp_path):
    """A 3-stage run (two boundaries): the same sample ids in the same order at dp1 and dp4; stage k's
    batches come only from its datasets; a dataset in two stages continues its own stream (no repeats)."""
    from megaframe.data.stages import StagedData

    paths = [
        dataset(tmp_path / "a", 0, 4000),
        dataset(tmp_path / "b", 30000, 1500),
        dataset(tmp_path / "c", 50000, 2000),
    ]
    data = StagedData({str(p): PreparedData(p, SEQ) for p in paths}, _staged(paths), 8, seed=3)
    source = {0: "a", 30000: "b", 50000: "c"}

    def step_tokens(step, dp, micro):
        return torch.cat([x for r in range(dp) for x, _ in microbatches(data, step, 8, micro, r, dp, 3)])

    for step in range(10):
        one = step_tokens(step, 1, 8)
        assert torch.equal(one, step_tokens(step, 4, 1)) and torch.equal(one, step_tokens(step, 2, 2))
        seen = {source[max(k for k in source if k <= int(t))] for t in one[:, 0]}
        assert seen <= [{"a"}, {"a", "c"}, {"b", "c"}][0 if step < 3 else 1 if step < 6 else 2], (step, seen)
    own = [data.locate(g)[1] for g in range(80) if data.locate(g)[0] == 0]  # dataset a over stages 0 and 1
    assert own == list(range(len(own))) and len(own) == 24 + 12
    assert [data.stage_of(g) for g in (0, 23, 24, 47, 48, 10**9)] == [0, 0, 1, 1, 2, 2]


def test_stages_from_the_command_line_and_their_checks(tmp_path):
    from megaframe.config import ConfigError
    from megaframe.data.stages import StagedData

    a, b = dataset(tmp_path / "a", 0, 4000), dataset(tmp_path / "b", 30000, 1500)
    stages = (
        f"[{{until_tokens: 640, blend: [{{path: {a}, weight: 1}}]}}, {{blend: [{{path: {b}, weight: 1}}]}}]"
    )
    cfg = load_config(
        ["data=demo", f"data.stages={stages}", "model.seq_length=8", "train.global_batch_size=16"],
        world_size=1,
        check_data=False,
    )
    data = build_data(cfg)  # 640 tokens = 80 samples: rounded up to whole global batches of 16
    assert isinstance(data, StagedData) and data.ends[0] == 80
    state = data_state(cfg.data, 1, cfg.train.seed, cfg.train.global_batch_size)
    assert [s["until_tokens"] for s in state["stages"]] == [640, None]
    for bad, needle in [
        (f"[{{blend: [{{path: {a}, weight: 1}}]}}, {{blend: [{{path: {b}, weight: 1}}]}}]", "no end"),
        (
            f"[{{until_step: 5, blend: [{{path: {a}, weight: 1}}]}}, {{until_step: 5, blend: "
            f"[{{path: {b}, weight: 1}}]}}]",
            "ends at or before",
        ),
        ("[{until_step: 5, blend: []}]", "needs a blend"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_config(
                ["data=demo", f"data.stages={bad}", "model.seq_length=8"], world_size=1, check_data=False
            )
