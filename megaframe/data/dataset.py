"""Samples and their order: the global batch of a step depends only on (seed, step), never on the layout.

A sample is seq_length + 1 consecutive tokens (inputs and shifted labels). Prepared data is read from
memory-mapped token shards; sample i of a split starts at token split_start + i * seq_length. The order
is a seeded bijection per epoch (megaframe.data.order: computed per position, O(1) memory), so global
position g (counting samples over the whole run) is sample perm_{g // N}(g % N). A blend of datasets
(megaframe.data.mixture, a blend or data stages) maps g to (dataset, its own position).
The data cursor is therefore derived, never stored: after step t, positions [0, t·G) are consumed, and a
run resumed under any dp continues at position t·G exactly.

Validation: with data.valid_fraction = f, a seeded random sample of each dataset's documents holding ~f
of its tokens (from the shards' document index; VALID_SEED, not train.seed) forms the "valid" split;
"train" samples come only from the other documents. Data without a document index holds out its tail.
Step t owns positions [t·G, (t+1)·G); dp rank d reads the block [d·G/dp, (d+1)·G/dp) of it in
micro-batches. The loss is a sum over tokens divided by the global token count, so any split of the
global batch over ranks and micro-batches gives the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megaframe.data.order import ORDER, sample_index
from megaframe.data.shards import check_token_range, read_index, read_meta
from megaframe.parallel.context import cp_keep
from megaframe.paths import inside

VALID_SEED = 20240917
"""Seed of the held-out documents: fixed (not train.seed), so every run on a dataset validates on the same
documents and val_loss stays comparable across seeds and layouts."""


class PreparedData:
    """Memory-mapped token shards written by megaframe.data.prepare; one split of them ("train",
    "valid", or "all") at a time. A split is a list of global token ranges (whole documents) read as one
    stream: sample i of the split is its tokens [i * seq_length, (i + 1) * seq_length + 1)."""

    shuffle = True
    touched: set | None = None

    @property
    def parts(self) -> list:
        """The file readers under it (Samples.parts): itself."""
        return [self]

    def __init__(self, path: str | Path, seq_length: int, split: str = "all", valid_fraction: float = 0.0):
        path = Path(path)
        try:  # shard entries checked: a damaged meta.json is one line naming the folder, not a TypeError
            meta = read_meta(path)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        dtype = np.dtype(meta["dtype"])
        self.path, self.meta = path, meta
        self.shards = [np.memmap(inside(path, s["file"]), dtype=dtype, mode="r") for s in meta["shards"]]
        for s, arr in zip(meta["shards"], self.shards):
            if arr.shape[0] != s["num_tokens"]:
                raise ValueError(
                    f"data shard {s['file']} has {arr.shape[0]} tokens, meta.json says {s['num_tokens']}"
                )
        self.starts = np.cumsum([0] + [a.shape[0] for a in self.shards])
        total = int(self.starts[-1])
        if split == "all" or valid_fraction <= 0:
            self.segments = np.array([[0, total]], dtype=np.int64)
        else:
            self.segments = self.split_segments(valid_fraction, split == "valid")
        self.seg_starts = np.cumsum([0] + [int(b - a) for a, b in self.segments])
        self.num_tokens = int(self.seg_starts[-1])
        self.seq_length = seq_length
        self.vocab_size = int(meta["vocab_size"])
        self.eos_ids = [int(meta["eos_id"])] if meta.get("eos_id") is not None else []  # data.document_mask
        # samples overlap by one token (a sample's last label is the next one's first input):
        # - 1 keeps the last sample whole
        self.num_samples = (self.num_tokens - 1) // seq_length
        if self.num_samples < 1:
            what = "the validation split" if split == "valid" else "data"
            raise ValueError(
                f"{path}: {what} has {self.num_tokens} tokens, fewer than one sample of {seq_length + 1}"
            )

    def document_starts(self) -> np.ndarray | None:
        """Global token offset of every document (shards hold whole documents), or None without an index."""
        entries = self.meta["shards"]
        if not entries or not all(e.get("docs") for e in entries):
            return None
        # each index checked (sha256, order, range): a corrupt entry would silently move the train/valid split
        parts = [read_index(self.path, e) + int(self.starts[k]) for k, e in enumerate(entries)]
        # 0 added: the stream's start is a document start even if an index omits it; unique also sorts
        return np.unique(
            np.concatenate([np.asarray(p, dtype=np.int64) for p in parts] + [np.zeros(1, np.int64)])
        )

    def split_segments(self, fraction: float, valid: bool) -> np.ndarray:
        """Token ranges of the train or valid split. Valid: whole documents drawn in a VALID_SEED-seeded
        random order until they hold fraction · T tokens (at least one, never all). Without a document
        index (older data) or with a single document, the tail from token (1 - f)·T is held out."""
        total = int(self.starts[-1])
        starts = self.document_starts()
        if starts is None or len(starts) < 2:
            cut = int(total * (1.0 - fraction))
            return np.array([[cut, total]] if valid else [[0, cut]], dtype=np.int64)
        ends = np.append(starts[1:], total)
        # VALID_SEED, not train.seed: every run on this data holds out the same documents
        order = np.random.default_rng(VALID_SEED).permutation(len(starts))
        held = np.cumsum((ends - starts)[order])
        # + 1 takes the document crossing f·T, so valid holds at least
        # f of the tokens; clamped so both splits keep a document
        k = min(max(1, int(np.searchsorted(held, fraction * total)) + 1), len(starts) - 1)
        chosen = np.zeros(len(starts), dtype=bool)
        chosen[order[:k]] = True
        keep = chosen if valid else ~chosen
        return _merge(starts[keep], ends[keep])

    def __getitem__(self, i: int) -> np.ndarray:
        lo = i * self.seq_length
        hi = lo + self.seq_length + 1
        pieces, j = [], int(np.searchsorted(self.seg_starts, lo, side="right") - 1)
        while lo < hi:  # a sample may span several held-out gaps
            a = int(self.segments[j][0]) + lo - int(self.seg_starts[j])
            end = min(hi, int(self.seg_starts[j + 1]))
            pieces.append(self._tokens(a, a + end - lo))
            lo, j = end, j + 1
        return np.concatenate(pieces).astype(np.int64)  # shards are uint16/32; torch indexes with int64

    def _tokens(self, lo: int, hi: int) -> np.ndarray:
        """Global tokens [lo, hi), across shard boundaries."""
        pieces, k = [], int(np.searchsorted(self.starts, lo, side="right") - 1)
        while lo < hi:
            end = min(hi, int(self.starts[k + 1]))
            piece = self.shards[k][lo - self.starts[k] : end - self.starts[k]]
            # every layout checks every read
            check_token_range(
                piece, self.vocab_size, self.path, self.meta["shards"][k]["file"], int(lo - self.starts[k])
            )
            if self.touched is not None:  # start-up verification records which shards a batch reads
                self.touched.add(k)
            pieces.append(piece)
            lo, k = end, k + 1
        return np.concatenate(pieces)


def _merge(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Adjacent [start, end) ranges joined: fewer segments, the same tokens."""
    out: list[list[int]] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return np.array(out, dtype=np.int64).reshape(-1, 2)


class SyntheticData:
    """Deterministic random tokens: sample i is drawn from a generator seeded by (seed, i).

    Each next token is (7 * previous + r) mod V with r uniform in [0, 8): learnable (the best loss is
    ln 8 ≈ 2.08 nats, against ln V for uniform tokens), so a synthetic run shows training working.
    Already random, endless and never repeated, so it is read in order (no permutation).
    """

    shuffle = False
    parts: list = []  # nothing on disk: no shard to check

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.num_samples = 1 << 62  # endless: positions never wrap into a second epoch
        # data.document_mask on synthetic data: ids that are multiples of 64 end a document (~1 in 64 tokens)
        self.eos_ids = list(range(0, vocab_size, 64))

    def __getitem__(self, i: int) -> np.ndarray:
        # seeded per sample: any rank reads any sample without drawing the ones before it
        rng = np.random.default_rng([self.seed, i])
        steps = rng.integers(0, 8, self.seq_length + 1, dtype=np.int64)
        steps[0] = rng.integers(0, self.vocab_size)
        out = np.empty_like(steps)
        prev = 0
        for j, r in enumerate(steps.tolist()):
            prev = (7 * prev + r) % self.vocab_size
            out[j] = prev
        return out


@dataclass(frozen=True)
class BatchShape:
    """The global batch a step reads and where the run's batches start in the sample order."""

    global_batch: int
    """Samples per step (train.global_batch_size), split over the dp ranks."""
    micro_batch: int
    """Samples per micro-batch (train.micro_batch_size)."""
    seed: int
    """train.seed: the order of the samples."""
    base: int = 0
    """The sample position step 0 starts at (a run resumed with another global batch continues from its
    consumed samples)."""


def microbatches(data, step: int, shape: BatchShape, mesh) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of step `step` (0-based, counted from `shape.base`): [(input_ids_BS,
    labels_BS), ...]. `mesh` places the reader: its dp rank reads a contiguous block of the global batch;
    under cp every cp rank reads the same samples and keeps its two chunks of each (parallel.context);
    the tokens go to `mesh.device`."""
    dp, cp, device = mesh.dp, mesh.cp, mesh.device
    per_rank = shape.global_batch // dp.size
    order = getattr(data, "order", ORDER)  # a resumed run keeps the order it began with
    # a contiguous block per dp rank: the global batch holds the same samples whatever dp is
    first = shape.base + step * shape.global_batch + dp.rank * per_rank
    out, m = [], shape.micro_batch
    for k in range(per_rank // m):
        pos = range(first + k * m, first + (k + 1) * m)
        ids = [sample_index(p, data.num_samples, shape.seed, order) if data.shuffle else p for p in pos]
        tokens = torch.from_numpy(np.stack([data[i] for i in ids]))
        if torch.device(device).type == "cuda":  # page-locked: the copy below runs async to the host
            tokens = tokens.pin_memory()
        tokens = tokens.to(device, non_blocking=True)
        # views of one copy, shifted by a token; under cp each rank keeps its two chunks of both
        out.append((cp_keep(tokens[:, :-1], cp.rank, cp.size), cp_keep(tokens[:, 1:], cp.rank, cp.size)))
    return out


class Prefetcher:
    """Reads step s+1's micro-batches on a background thread while step s computes.

    `load(step)` returns a step's batches (microbatches(...) bound to the run); steps are asked for in
    order from `first` to `last`. Reading is numpy memory-map work that releases the GIL; on CUDA the
    tokens are pinned and copied with non_blocking=True on the thread's (default) stream, so the copy is
    ordered before the step that uses it. What a step gets is exactly what `load` returns: the order of
    samples and the losses do not change.
    """

    def __init__(self, load, first: int, last: int):
        from concurrent.futures import ThreadPoolExecutor

        self.load, self.last = load, last
        # one worker: steps are read in order, and at most one step's batches wait in memory
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megaframe-data")
        self.ahead = (first, self.pool.submit(load, first)) if first <= last else None

    def get(self, step: int):
        if self.ahead is None or self.ahead[0] != step:  # out of order (not the trainer's loop): read now
            return self.load(step)
        batches = self.ahead[1].result()  # re-raises a read error here, in the step that needs the data
        self.ahead = (step + 1, self.pool.submit(self.load, step + 1)) if step < self.last else None
        return batches

    def close(self) -> None:
        # wait: the worker may be inside a read of the mmap; the not-started next step is cancelled
        self.pool.shutdown(wait=True, cancel_futures=True)
