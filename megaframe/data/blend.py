"""A deterministic weighted blend of datasets, Megatron-style (its build_blending_indices).

Position g of the run's sample stream goes to the dataset whose share is furthest behind its weight:
d(g) = argmax_d (w_d·(g+1) - n_d(g)), n_d(g) = samples dataset d got before g. This greedy choice keeps
every prefix of the stream within one sample per dataset of the target proportions, so every global
batch, not just the whole run, has the blend's mix. It is computed once for a block of BLOCK positions
and repeated (the block's counts are within one of BLOCK·w_d, an error under 1e-4): dataset and local
position of g are then O(1), with no state, whatever g is (resume at any step, under any dp).

Each dataset walks its own positions 0, 1, 2, ... through its own seeded per-epoch permutation, so a
small dataset that the weights oversample simply starts new epochs sooner.
"""

from __future__ import annotations

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
        d = int(np.argmax(w * (g + 1) - counts))  # ties go to the lower index: deterministic
        which[g], rank[g] = d, counts[d]
        counts[d] += 1
    return which, rank, counts


class BlendedData:
    """Datasets mixed by weight; data[g] is the sample at global position g (no outer shuffle)."""

    shuffle = False
    order = ORDER  # the parts' order; a resumed run sets the one it began with

    def __init__(self, parts: list, weights: list[float], seed: int):
        if len(parts) != len(weights) or not parts:
            raise ValueError("a blend needs one weight per dataset")
        self.parts, self.seed = parts, seed
        self.weights = [float(x) / sum(weights) for x in weights]
        self.which, self.rank, self.counts = blend_pattern(self.weights)
        self.seq_length = parts[0].seq_length
        # the parts share one tokenizer (check_datasets refuses otherwise); the max bounds every id
        self.vocab_size = max(p.vocab_size for p in parts)
        self.eos_ids = parts[0].eos_ids  # one tokenizer (check_datasets): one end-of-document id
        self.num_samples = sum(p.num_samples for p in parts)  # for display: one epoch of every dataset

    def locate(self, position: int) -> tuple[int, int]:
        """(dataset, that dataset's own stream position) of a global position."""
        block, r = divmod(int(position), len(self.which))
        d = int(self.which[r])
        # blocks repeat: dataset d's own position is its count in all earlier blocks plus its rank in this one
        return d, block * int(self.counts[d]) + int(self.rank[r])

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
