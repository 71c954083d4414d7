"""Data stages: the blend changes during the run (`data.stages`), e.g. annealing on high-quality data at the
end (Llama 3, OLMo 2; nanotron's data stages).

    data.stages='[{until_step: 1000, blend: [{path: /d/web, weight: 1}]},
                  {until_tokens: 3e9, blend: [{path: /d/web, weight: 0.7}, {path: /d/code, weight: 0.3}]},
                  {blend: [{path: /d/books, weight: 0.5}, {path: /d/code, weight: 0.5}]}]'

Stage k covers global sample positions [P_{k-1}, P_k): P_k = until_step · global_batch, or until_tokens
rounded UP to whole global batches (a step never mixes two stages: every dp rank switches at the same
step, whatever dp is). The last stage may omit its end and runs to the end of the run.

Within a stage, position g is Megatron's greedy blend (data/blend.py) of that stage's weights, at the
stage's own position g - P_{k-1}. Each dataset keeps ONE stream over the whole run: its position in stage
k starts where the earlier stages left it (the samples it gave them, counted exactly from the blend
pattern), and its per-epoch order is seeded by the dataset's index in the union of every stage's datasets.
So a dataset in two stages never repeats a sample between them before its epoch ends, and everything
is a function of the position alone: a resume anywhere (inside a stage too) continues the same stream
under any dp, with nothing saved but the step. The checkpoint's data state records the stages.
"""

from __future__ import annotations

import math

import numpy as np

from megaframe.data.blend import blend_pattern
from megaframe.data.order import ORDER, sample_index


def stage_ends(stages, global_batch: int, seq_length: int) -> list[float]:
    """P_k of each stage in global sample positions (inf for an open last stage)."""
    ends = []
    for s in stages:
        if s.until_step is not None:
            ends.append(float(s.until_step * global_batch))
        elif s.until_tokens is not None:  # rounded up to a whole step: one mixture per global batch
            ends.append(float(math.ceil(s.until_tokens / (seq_length * global_batch)) * global_batch))
        else:
            ends.append(math.inf)
    return ends


def _taken(which: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """Samples each dataset gets in the first n positions of a repeating blend pattern."""
    full, rest = divmod(n, len(which))
    return full * counts + np.bincount(which[:rest], minlength=len(counts))


class StagedData:
    """Datasets mixed by a blend that changes at stage boundaries; data[g] is the sample at position g."""

    shuffle = False
    order = ORDER  # the datasets' order; a resumed run sets the one it began with

    def __init__(self, parts: dict, stages, global_batch: int, seed: int):
        """parts: {path: PreparedData} over every stage's datasets (one per folder); stages: data.stages
        entries."""
        from megaframe.data.record import resolved

        self.paths = [resolved(p) for p in parts]  # one stream per folder, however a stage spells it
        self.parts = [parts[p] for p in self.paths]
        self.seed = seed
        self.ends = stage_ends(stages, global_batch, self.parts[0].seq_length)
        self.seq_length = self.parts[0].seq_length
        self.vocab_size = max(p.vocab_size for p in self.parts)
        self.eos_ids = self.parts[0].eos_ids  # one tokenizer (check_datasets): one end-of-document id
        self.num_samples = sum(p.num_samples for p in self.parts)  # for display: one epoch of every dataset
        # per stage: (start, global dataset ids, pattern, start offset of each global dataset)
        self.stages = []
        offset, start = np.zeros(len(self.parts), dtype=np.int64), 0
        for k, s in enumerate(stages):
            ids = np.array([self.paths.index(resolved(b.path)) for b in s.blend], dtype=np.int64)
            which, rank, counts = blend_pattern([b.weight for b in s.blend])
            self.stages.append((start, ids, (which, rank, counts), offset.copy()))
            if k + 1 < len(stages):  # the samples this stage gave each dataset carry into the next
                np.add.at(offset, ids, _taken(which, counts, int(self.ends[k]) - start))
                start = int(self.ends[k])

    def stage_of(self, position: int) -> int:
        """The stage that position (a global sample position) falls in."""
        return next(k for k, end in enumerate(self.ends) if position < end or k == len(self.ends) - 1)

    def locate(self, position: int) -> tuple[int, int]:
        """(global dataset index, that dataset's own stream position) of a global position."""
        start, ids, (which, rank, counts), offset = self.stages[self.stage_of(position)]
        block, r = divmod(int(position) - start, len(which))
        d = int(which[r])
        return int(ids[d]), int(offset[ids[d]]) + block * int(counts[d]) + int(rank[r])

    def __getitem__(self, position: int) -> np.ndarray:
        d, local = self.locate(position)
        part = self.parts[d]
        # seeded by the dataset's index in the union: one permutation per dataset over the whole run
        idx = (
            sample_index(local, part.num_samples, self.seed * 257 + d + 1, self.order)
            if part.shuffle
            else local
        )
        return part[idx]


def stage_metric(data, consumed_samples: int) -> dict:
    """{"data/stage": the stage of the last sample consumed} for a staged run's log line, else {}."""
    if not isinstance(data, StagedData) or consumed_samples <= 0:
        return {}
    return {"data/stage": data.stage_of(consumed_samples - 1)}
