"""One mixture of datasets for a blend and for data stages: position g of the run's sample stream goes to
a dataset by Megatron's greedy blend (its build_blending_indices) of the weights of the stage g lies in.

Greedy blend: d(g) = argmax_d (w_d·(g+1) - n_d(g)), n_d(g) = samples dataset d got before g. The choice keeps
every prefix of the stream within one sample per dataset of the target proportions, so every global
batch, not just the whole run, has the mix. It is computed once for a block of BLOCK positions and
repeated (the block's counts are within one of BLOCK·w_d, an error under 1e-4): dataset and local position
of g are then O(1), with no state, whatever g is (resume at any step, under any dp).

A blend is one open stage. With stages (data/stages.py) each dataset keeps ONE stream over the whole run:
its position in stage k starts where the earlier stages left it (the samples it gave them, counted exactly
from the blend pattern), and its per-epoch order is seeded by its index among the mixture's datasets, so
a small dataset the weights oversample simply starts new epochs sooner.
"""

from __future__ import annotations

import math

import numpy as np

from megaframe.data.order import ORDER, sample_index

# the greedy loop runs once at start-up (milliseconds),
# and one block's rounding stays under 1e-4 of the weights
BLOCK = 1 << 14


def blend_pattern(weights: list[float], block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset of each position in a block, its rank within that dataset in the block, per-dataset
    counts)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    which = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    for g in range(block):
        # ties go to the lower index: deterministic
        d = int(np.argmax(w * (g + 1) - counts))
        which[g], rank[g] = d, counts[d]
        counts[d] += 1
    return which, rank, counts


def _taken(which: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """Samples each dataset gets in the first n positions of a repeating blend pattern."""
    full, rest = divmod(n, len(which))
    return full * counts + np.bincount(which[:rest], minlength=len(counts))


class Mixture:
    """Datasets mixed by weights that may change at stage ends; data[g] is the sample at position g (no
    outer shuffle: each dataset walks its own seeded order)."""

    shuffle = False
    order = ORDER  # the datasets' order; a resumed run sets the one it began with

    def __init__(self, parts: list, stages: list[list[tuple[int, float]]], ends: list[float], seed: int):
        """parts: one reader per dataset; stages: each stage's (dataset index, weight) pairs; ends: the
        position each stage ends at (math.inf: open, the last one only)."""
        self.parts, self.seed, self.ends = list(parts), seed, list(ends)
        self.seq_length = self.parts[0].seq_length
        # the parts share one tokenizer (check_datasets refuses otherwise); the max bounds every id
        self.vocab_size = max(p.vocab_size for p in self.parts)
        self.eos_ids = self.parts[0].eos_ids  # one tokenizer: one end-of-document id
        self.num_samples = sum(p.num_samples for p in self.parts)  # for display: one epoch of every dataset
        # per stage: (start, dataset ids, pattern, start offset of each dataset)
        self.stages = []
        offset, start = np.zeros(len(self.parts), dtype=np.int64), 0
        for k, mix in enumerate(stages):
            ids = np.array([i for i, _ in mix], dtype=np.int64)
            which, rank, counts = blend_pattern([w for _, w in mix])
            self.stages.append((start, ids, (which, rank, counts), offset.copy()))
            if k + 1 < len(stages):  # the samples this stage gave each dataset carry into the next
                np.add.at(offset, ids, _taken(which, counts, int(self.ends[k]) - start))
                start = int(self.ends[k])

    def stage_of(self, position: int) -> int:
        """The stage that position (a global sample position) falls in."""
        return next(k for k, end in enumerate(self.ends) if position < end or k == len(self.ends) - 1)

    def locate(self, position: int) -> tuple[int, int]:
        """(dataset index, that dataset's own stream position) of a global position."""
        start, ids, (which, rank, counts), offset = self.stages[self.stage_of(position)]
        block, r = divmod(int(position) - start, len(which))
        d = int(which[r])
        # blocks repeat: the dataset's position is its count in all earlier blocks plus its rank in this one
        return int(ids[d]), int(offset[ids[d]]) + block * int(counts[d]) + int(rank[r])

    def __getitem__(self, position: int) -> np.ndarray:
        d, local = self.locate(position)
        part = self.parts[d]
        # a per-dataset seed: two datasets of equal size must not share one permutation
        idx = (
            sample_index(local, part.num_samples, self.seed * 257 + d + 1, self.order)
            if part.shuffle
            else local
        )
        return part[idx]


class BlendedData(Mixture):
    """Datasets mixed by weight (data.blend): one open stage."""

    def __init__(self, parts: list, weights: list[float], seed: int):
        if len(parts) != len(weights) or not parts:
            raise ValueError("a blend needs one weight per dataset")
        self.weights = [float(x) / sum(weights) for x in weights]
        super().__init__(parts, [list(enumerate(self.weights))], [math.inf], seed)
        _, _, (self.which, self.rank, self.counts), _ = self.stages[0]
