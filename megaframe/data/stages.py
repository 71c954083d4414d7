"""Data stages: the blend changes during the run (`data.stages`), e.g. annealing on high-quality data at the
end (Llama 3, OLMo 2; nanotron's data stages).

    data.stages='[{until_step: 1000, blend: [{path: /d/web, weight: 1}]},
                  {until_tokens: 3e9, blend: [{path: /d/web, weight: 0.7}, {path: /d/code, weight: 0.3}]},
                  {blend: [{path: /d/books, weight: 0.5}, {path: /d/code, weight: 0.5}]}]'

Stage k covers global sample positions [P_{k-1}, P_k): P_k = until_step · global_batch, or until_tokens
rounded UP to whole global batches (a step never mixes two stages: every dp rank switches at the same
step, whatever dp is). The last stage may omit its end and runs to the end of the run.

Within a stage, position g is the greedy blend (data/mixture.py, the one a plain blend is) of that stage's
weights, at the stage's own position g - P_{k-1}. Each dataset keeps ONE stream over the whole run, seeded
by its index in the union of every stage's datasets: a dataset in two stages never repeats a sample
between them before its epoch ends, and a resume anywhere (inside a stage too) continues the same stream
under any dp, with nothing saved but the step. The checkpoint's data state records the stages.
"""

from __future__ import annotations

import math

from megaframe.data.mixture import Mixture


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


class StagedData(Mixture):
    """Datasets mixed by a blend that changes at stage boundaries; data[g] is the sample at position g."""

    def __init__(self, parts: dict, stages, global_batch: int, seed: int):
        """parts: {path: PreparedData} over every stage's datasets (one per folder); stages: data.stages
        entries."""
        from megaframe.data.record import resolved

        # one stream per folder, however a stage spells it
        self.paths = [resolved(p) for p in parts]
        mixes = [[(self.paths.index(resolved(b.path)), b.weight) for b in s.blend] for s in stages]
        first = next(iter(parts.values()))
        ends = stage_ends(stages, global_batch, first.seq_length)
        super().__init__(list(parts.values()), mixes, ends, seed)


def stage_metric(data, consumed_samples: int) -> dict:
    """{"data/stage": the stage of the last sample consumed} for a staged run's log line, else {}."""
    if not isinstance(data, StagedData) or consumed_samples <= 0:
        return {}
    return {"data/stage": data.stage_of(consumed_samples - 1)}
