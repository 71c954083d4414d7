"""Run-time data kinds are registered by name (megaframe/data/kinds.py): every registered kind goes through
the same paths as a run does (a resume reads the same samples, the checkpoint's record compares equal to
its own run and names a switch of kind, the first batch's shards verify), and a kind registered only here
runs through them with no other file touched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megaframe.config import load_config
from megaframe.config.choices import DataKind
from megaframe.data import kinds
from megaframe.data.verify import first_batch_shards, verify
from megaframe.training.startup import run_samples
from tests.forms import microbatches

SMALL = ["model.seq_length=8", "train.global_batch_size=8", "train.micro_batch_size=2"]
# the config that selects each registered kind (a new kind adds its line: the test below asks for one)
KIND_CONFIG = {
    "prepared": lambda demo: ["data=demo", f"data.path={demo}"],
    "synthetic": lambda demo: ["data=synthetic"],
}


def test_the_config_choices_are_the_registered_kinds():
    assert [k.value for k in DataKind] == list(kinds.DATA_KINDS) == list(KIND_CONFIG)


def _batches(data, step: int, dp: int, seed: int) -> np.ndarray:
    """The global batch of `step` as dp ranks read it, concatenated in rank order."""
    rows = [x for r in range(dp) for x, _ in microbatches(data, step, 8, 2, r, dp, seed)]
    return np.concatenate([x.numpy() for x in rows])


def _conforms(cfg, data) -> None:
    """One kind through a run's paths: resume, record, first shards."""
    t = cfg.train
    # a resume builds the data again: the step's samples are a function of (seed, step), under any dp
    again = run_samples(cfg)
    assert np.array_equal(_batches(data, 3, 1, t.seed), _batches(again, 3, 2, t.seed))
    # the record: its own run compares equal; a switch of kind is named
    state = kinds.data_state(cfg.data, 3, t.seed, t.global_batch_size)
    meta = {"data": state, "config": {"data": {"kind": str(cfg.data.kind)}}}
    assert kinds.data_changes(cfg.data, meta) == []
    meta["config"]["data"]["kind"] = "another"
    assert [c[0] for c in kinds.data_changes(cfg.data, meta)] == ["data.kind"]
    # the first batch's shards verify (none for a kind reading no folder)
    shards = first_batch_shards(data, 0, t.global_batch_size, 0, t.seed)
    assert bool(shards) == bool(kinds.data_folders(cfg.data))
    for folder, files in shards.items():
        assert verify(folder, files) > 0
    assert kinds.data_kind(cfg.data.kind).label(cfg.data)


@pytest.mark.parametrize("name", list(kinds.DATA_KINDS))
def test_every_registered_kind_resumes_records_and_verifies(name, demo_prepared):
    cfg = load_config([*KIND_CONFIG[name](demo_prepared), *SMALL], world_size=1)
    _conforms(cfg, run_samples(cfg))


class _Counting:
    """A toy kind's reader: sample i counts up from i (endless, no files)."""

    shuffle, parts, eos_ids, num_samples = False, [], [], 1 << 62

    def __init__(self, seq: int):
        self.seq_length, self.vocab_size = seq, 64

    def __getitem__(self, i: int) -> np.ndarray:
        return (np.arange(self.seq_length + 1) + i) % 64


def test_a_kind_registered_elsewhere_runs_through_the_same_paths(monkeypatch):
    toy = kinds.DataKindSpec(
        name="counting", build=lambda d, seq, *_: _Counting(seq), label=lambda d: "counting", endless=True
    )
    monkeypatch.setitem(kinds.DATA_KINDS, "counting", toy)
    base = load_config(["data=synthetic", *SMALL], world_size=1)
    cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, kind="counting"))
    data = run_samples(cfg)
    assert isinstance(data, _Counting)
    _conforms(cfg, data)
    assert kinds.tokenizer_identity(cfg.data) is None and not kinds.reads_folders("counting")
