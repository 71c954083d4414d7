"""Samples and their order: the global batch of a step depends only on (seed, step), never on the layout.

A sample is seq_length + 1 consecutive tokens (inputs and shifted labels). Prepared data is read from
memory-mapped token shards; sample i starts at token i * seq_length. The order is a seeded permutation
per epoch, so global position g (counting samples over the whole run) is sample perm_{g // N}[g % N].
Step t owns positions [t·G, (t+1)·G); dp rank d reads the block [d·G/dp, (d+1)·G/dp) of it in
micro-batches. The loss is a sum over tokens divided by the global token count, so any split of the
global batch over ranks and micro-batches gives the same gradient.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


class PreparedData:
    """Memory-mapped token shards written by megaframe.data.prepare."""

    shuffle = True

    def __init__(self, path: str | Path, seq_length: int):
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        self.shards = [np.memmap(path / s["file"], dtype=dtype, mode="r") for s in meta["shards"]]
        for s, arr in zip(meta["shards"], self.shards):
            if arr.shape[0] != s["num_tokens"]:
                raise ValueError(f"data shard {s['file']} has {arr.shape[0]} tokens, meta.json says {s['num_tokens']}")
        self.starts = np.cumsum([0] + [a.shape[0] for a in self.shards])
        self.num_tokens = int(self.starts[-1])
        self.seq_length = seq_length
        self.vocab_size = int(meta["vocab_size"])
        self.num_samples = (self.num_tokens - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"data has {self.num_tokens} tokens, fewer than one sample of {seq_length + 1}")

    def __getitem__(self, i: int) -> np.ndarray:
        lo, hi = i * self.seq_length, i * self.seq_length + self.seq_length + 1
        pieces, k = [], int(np.searchsorted(self.starts, lo, side="right") - 1)
        while lo < hi:  # a sample may straddle shard boundaries
            end = min(hi, int(self.starts[k + 1]))
            pieces.append(self.shards[k][lo - self.starts[k]:end - self.starts[k]])
            lo, k = end, k + 1
        return np.concatenate(pieces).astype(np.int64)


class SyntheticData:
    """Deterministic random tokens: sample i is drawn from a generator seeded by (seed, i).

    Each next token is (7 * previous + r) mod V with r uniform in [0, 8): learnable (the best loss is
    ln 8 ≈ 2.08 nats, against ln V for uniform tokens), so a synthetic run shows training working.
    Already random, endless and never repeated, so it is read in order (no permutation).
    """

    shuffle = False

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.num_samples = 1 << 62

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        steps = rng.integers(0, 8, self.seq_length + 1, dtype=np.int64)
        steps[0] = rng.integers(0, self.vocab_size)
        out = np.empty_like(steps)
        prev = 0
        for j, r in enumerate(steps.tolist()):
            prev = (7 * prev + r) % self.vocab_size
            out[j] = prev
        return out


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(num_samples)


def sample_index(position: int, num_samples: int, seed: int) -> int:
    """Sample id at a global position in the run's sample stream (layout-free)."""
    epoch, offset = divmod(position, num_samples)
    return int(_epoch_permutation(num_samples, seed, epoch)[offset])


def microbatches(data, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's micro-batches of step `step` (0-based): [(input_ids_BS, labels_BS), ...]."""
    per_rank = global_batch // dp_size
    first = step * global_batch + dp_rank * per_rank
    out = []
    for m in range(per_rank // micro_batch):
        pos = range(first + m * micro_batch, first + (m + 1) * micro_batch)
        ids = [sample_index(p, data.num_samples, seed) if data.shuffle else p for p in pos]
        tokens = torch.from_numpy(np.stack([data[i] for i in ids]))
        tokens = tokens.to(device, non_blocking=True)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def build_data(cfg) -> PreparedData | SyntheticData:
    if cfg.data.kind == "synthetic":
        return SyntheticData(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
    return PreparedData(cfg.data.path, cfg.model.seq_length)
