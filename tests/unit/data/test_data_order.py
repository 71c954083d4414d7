"""Sample order is layout-free: a step's global batch depends on (seed, step) only, however it is split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megaframe.data.dataset import PreparedData, SyntheticData, sample_index
from tests.forms import microbatches

SEQ = 6


class Labelled:
    """A shuffled dataset whose sample i is the tokens i*1000 + [0, SEQ]: each token names its sample."""

    shuffle = True

    def __init__(self, num_samples: int):
        self.num_samples = num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return i * 1000 + np.arange(SEQ + 1, dtype=np.int64)


def global_batch(data, step, g, micro, dp, seed=11):
    """Every dp rank's micro-batches of `step`, concatenated in rank then micro-batch order."""
    ins, labs = [], []
    for rank in range(dp):
        mbs = microbatches(data, step, g, micro, rank, dp, seed)
        assert len(mbs) == g // dp // micro
        for x, y in mbs:
            assert x.shape == y.shape == (micro, SEQ) and x.dtype == torch.int64
            ins.append(x)
            labs.append(y)
    return torch.cat(ins), torch.cat(labs)


LAYOUTS = [(dp, micro) for dp in (1, 2, 4) for micro in (1, 2, 4) if 8 % (dp * micro) == 0]


@pytest.mark.parametrize(
    "make", [lambda: Labelled(37), lambda: SyntheticData(97, SEQ, 5)], ids=["shuffled", "synthetic"]
)
@pytest.mark.parametrize("step", [0, 3, 9])
@pytest.mark.parametrize("dp,micro", LAYOUTS)
def test_union_over_dp_ranks_is_the_dp1_global_batch(make, step, dp, micro):
    data = make()
    want_x, want_y = global_batch(data, step, 8, 8, 1)
    got_x, got_y = global_batch(data, step, 8, micro, dp)
    assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)
    assert torch.equal(got_x[:, 1:], got_y[:, :-1])  # labels are the inputs shifted by one


def ids_of_step(data, step, g=8, seed=11):
    x, _ = global_batch(data, step, g, g, 1, seed)
    return (x[:, 0] // 1000).tolist()


def test_steps_read_different_samples_within_an_epoch():
    data = Labelled(40)
    seen = [i for step in range(5) for i in ids_of_step(data, step)]  # 5 steps x 8 = one epoch of 40
    assert sorted(seen) == list(range(40))
    assert ids_of_step(data, 0) != ids_of_step(data, 5)  # next epoch, new order
    assert ids_of_step(data, 0) != ids_of_step(data, 0, seed=12)


def test_batch_is_the_run_order_at_positions_step_times_global_batch():
    data = Labelled(37)
    assert ids_of_step(data, 6) == [
        sample_index(p, 37, 11) for p in range(48, 56)
    ]  # straddles epochs 1 and 2


def test_synthetic_steps_are_consecutive_samples():
    data = SyntheticData(97, SEQ, 5)
    x, y = global_batch(data, 2, 8, 4, 2)
    for row, i in enumerate(range(16, 24)):
        full = data[i]
        assert np.array_equal(x[row].numpy(), full[:-1]) and np.array_equal(y[row].numpy(), full[1:])
    a, _ = global_batch(data, 0, 8, 8, 1)
    b, _ = global_batch(data, 1, 8, 8, 1)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_sample_index_is_a_permutation_per_epoch(n):
    perms = [[sample_index(e * n + o, n, 3) for o in range(n)] for e in range(3)]
    for p in perms:
        assert sorted(p) == list(range(n))
    if n > 2:
        assert perms[0] != perms[1] != perms[2]
        assert perms[0] != [sample_index(o, n, 4) for o in range(n)]
        assert perms[0] != list(range(n))
    assert perms[1] == [sample_index(n + o, n, 3) for o in range(n)]  # a pure function


def test_synthetic_is_deterministic_per_seed_and_index():
    a, b, c = SyntheticData(50, 32, 1), SyntheticData(50, 32, 1), SyntheticData(50, 32, 2)
    for i in (0, 1, 12345, (1 << 40) + 7):
        s = a[i]
        assert s.shape == (33,) and s.dtype == np.int64
        assert np.array_equal(s, b[i])
        assert not np.array_equal(s, c[i])
        assert s.min() >= 0 and s.max() < 50
        assert set(((s[1:] - 7 * s[:-1]) % 50).tolist()) <= set(range(8))  # the learnable rule
    assert not np.array_equal(a[0], a[1])


def write_prepared(folder: Path, shards: list[np.ndarray], vocab: int = 60000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for k, arr in enumerate(shards):
        name = f"tokens_{k:05d}.bin"
        arr.astype(np.uint16).tofile(folder / name)
        entries.append({"file": name, "num_tokens": int(arr.size)})
    meta = {
        "format": "megaframe-tokens-v1",
        "vocab_size": vocab,
        "eos_id": 1,
        "dtype": "uint16",
        "num_tokens": int(sum(a.size for a in shards)),
        "shards": entries,
        "tokenizer": "tokenizer.model",
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("sizes", [(10, 15), (10, 2, 13), (7, 3, 3, 12), (25,)])
def test_prepared_data_reads_samples_across_shards(tmp_path, sizes):
    tokens = np.arange(40000, 40000 + sum(sizes))  # > 2^15: uint16 must stay unsigned
    cuts = np.cumsum(sizes)[:-1]
    path = write_prepared(tmp_path / "prep", np.split(tokens, cuts))
    data = PreparedData(path, seq_length=4)
    assert data.num_tokens == 25 and data.num_samples == 6 and data.vocab_size == 60000
    for i in range(data.num_samples):
        s = data[i]
        assert s.dtype == np.int64
        assert np.array_equal(s, tokens[i * 4 : i * 4 + 5]), (i, s)


def test_prepared_microbatches_straddle(tmp_path):
    tokens = np.arange(30)
    path = write_prepared(tmp_path / "prep", [tokens[:13], tokens[13:]])
    data = PreparedData(path, seq_length=SEQ)  # 4 samples; sample 2 is tokens 12..18
    x, y = global_batch(data, 0, 4, 2, 2)
    starts = [sample_index(p, 4, 11) * SEQ for p in range(4)]
    assert x[:, 0].tolist() == starts and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], torch.tensor(starts) + SEQ)


def test_prepared_data_refuses_a_shard_shorter_than_meta(tmp_path):
    path = write_prepared(tmp_path / "prep", [np.arange(10), np.arange(15)])
    meta = json.loads((path / "meta.json").read_text())
    meta["shards"][1]["num_tokens"] = 16
    meta["num_tokens"] = 26  # the total agrees: the shard's own size is what is wrong
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="tokens_00001.bin"):
        PreparedData(path, seq_length=4)


def test_prepared_data_refuses_less_than_one_sample(tmp_path):
    path = write_prepared(tmp_path / "prep", [np.arange(5)])
    with pytest.raises(ValueError, match="fewer than one sample"):
        PreparedData(path, seq_length=5)
    assert PreparedData(path, seq_length=4).num_samples == 1


def test_order_of_a_1_8g_sample_corpus_takes_constant_memory():
    """The order is a function of the sample count: 1.8 G samples (15 T tokens at seq 8192) cost what
    64 do. The old per-epoch int64 permutation would hold 14.4 GB in every process."""
    import time
    import tracemalloc

    n = 1_800_000_000
    tracemalloc.start()
    ids = [sample_index(p, n, 11) for p in range(0, 2_000)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < n
    assert peak - len(ids) * 64 < 64 * 1024, peak  # beyond the list of results: a few KB of keys
    t0 = time.perf_counter()
    more = [sample_index(p, n, 11) for p in range(2_000, 12_000)]
    each = (time.perf_counter() - t0) / len(more)
    assert len(set(ids + more)) == len(ids) + len(more)
    assert each < 2e-3, each  # tens of microseconds on an idle core; generous for a shared machine
    print(
        f"order of {n} samples: peak {peak / 1024:.1f} KiB traced for 2000 lookups "
        f"({each * 1e6:.1f} us per lookup untraced); old permutation {n * 8 / 1e9:.1f} GB per process"
    )
    # a spread-out order: consecutive positions land all over [0, n)
    assert np.std(np.array(ids[:2000], dtype=np.float64) / n) > 0.25


def test_resumed_run_keeps_the_order_it_began_with():
    from megaframe.data import order

    assert order.resumed_order({"data": {"order": order.ORDER}}) == order.ORDER
    old = {"consumed_samples": 64, "data": {"kind": "prepared", "consumed_samples": 64}}
    assert order.resumed_order(old) == order.LEGACY  # written before orders had names
    # a checkpoint that never drew a sample has no order to keep: an import from before imports recorded one
    imported = {
        "consumed_samples": 0,
        "imported_from": "/hf/llama",
        "data": {"kind": "prepared", "consumed_samples": 0},
    }
    assert order.resumed_order(imported) == order.ORDER
    legacy = [order.sample_index(p, 37, 11, order.LEGACY) for p in range(37)]
    assert legacy == np.random.default_rng([11, 0, 0x5EED]).permutation(37).tolist()
    data = Labelled(37)
    data.order = order.LEGACY
    x, _ = global_batch(data, 1, 8, 8, 1)
    assert (x[:, 0] // 1000).tolist() == legacy[8:16]
    with pytest.raises(ValueError, match="unknown data order"):
        order.sample_index(0, 37, 11, "nope")
