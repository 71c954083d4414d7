"""Run-time data kinds (data.kind), registered by name: what a run reads its samples from, and what the
wiring, the checkpoint's record, start-up's shard check, evaluate and the config checks ask of it.

A kind is a `DataKindSpec`; the dataset it builds is a `Samples`. Everything above data/ asks this module
(`data_kind`, `build_samples`, `data_folders`, `data_state`, `data_changes`, `tokenizer_identity`) and
never tests `data.kind` itself. Add a kind: a `DataKindSpec` registered here (`register`), its reader in a
module of its own, and its name in config/choices.py: DataKind (the schema leaf cannot import this
registry; tests/unit/data/test_data_kinds.py holds the two equal and runs every registered kind through
a resume, the record's comparison and the first batch's shard check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megaframe.config.schema import DataConfig
from megaframe.data.order import ORDER


class Samples(Protocol):
    """A run-time dataset: sample i is seq_length + 1 consecutive tokens (inputs and shifted labels)."""

    num_samples: int
    """Samples in one epoch (the position order wraps after it); 1 << 62 for an endless kind."""
    shuffle: bool
    """Positions pass through the seeded per-epoch order (data/order.py); False: the kind orders its own."""
    eos_ids: list[int]
    """End-of-document ids (data.document_mask); [] when the data records none."""
    parts: list
    """The file readers under it, each with `path`, `meta` and a `touched` set the first batch's shard check
    fills ([]: nothing on disk to check)."""

    def __getitem__(self, i: int) -> np.ndarray: ...


@dataclass(frozen=True, kw_only=True)
class DataKindSpec:
    """One data kind, chosen by data.kind."""

    name: str
    build: Callable[[DataConfig, int, int, int, int, str], Samples]
    """(data group, seq_length, model.vocab_size, train.seed, train.global_batch_size, split) -> Samples;
    split is "train", "valid" or "all". Raises OSError/ValueError on unreadable data."""
    label: Callable[[DataConfig], str]
    """What the run's header calls the data."""
    folders: Callable[[DataConfig], list[tuple[str, str]]] | None = None
    """(config key, folder) of every prepared folder it reads: checked at load, fingerprinted in the
    checkpoint's record, its tokenizer recorded and compared; None: the kind reads no folder."""
    changes: Callable[[DataConfig, dict], list[tuple[str, str, str, str]]] | None = None
    """What a resume compares beyond the kind (the checkpoint's `data` record -> changes); None: nothing."""
    endless: bool = False
    """Never wraps into a second epoch (the header says "endless")."""
    own_valid: bool = False
    """Has a validation stream without data.valid_fraction (train.eval_interval needs no held-out split)."""


DATA_KINDS: dict[str, DataKindSpec] = {}


def register(spec: DataKindSpec) -> DataKindSpec:
    if spec.name in DATA_KINDS:
        raise ValueError(f"data kind {spec.name!r} is registered already")
    DATA_KINDS[spec.name] = spec
    return spec


def data_kind(kind) -> DataKindSpec:
    """The registered kind of a name (data.kind, or the kind a checkpoint recorded)."""
    name = str(getattr(kind, "value", kind))
    if name not in DATA_KINDS:
        raise ValueError(f"data.kind={name} is none of {', '.join(DATA_KINDS)}")
    return DATA_KINDS[name]


def data_folders(d: DataConfig) -> list[tuple[str, str]]:
    """(config key, folder) of every prepared folder the data group reads ([] for a kind reading none)."""
    spec = data_kind(d.kind)
    return spec.folders(d) if spec.folders else []


def build_samples(
    d: DataConfig, seq: int, vocab_size: int, seed: int, global_batch: int, split: str = "train"
) -> Samples:
    """The training (or, with split="valid", validation) samples of the data group `d`, cut into samples
    of `seq` tokens. `vocab_size` (model.vocab_size) bounds generated ids; `seed` (train.seed) orders
    mixtures and seeds generated data; `global_batch` rounds stage ends to whole steps. Raises
    OSError/ValueError on unreadable data (callers make it a ConfigError)."""
    return data_kind(d.kind).build(d, seq, vocab_size, seed, global_batch, split)


def data_state(d: DataConfig, step: int, seed: int, global_batch: int, order: str = ORDER) -> dict:
    """The data cursor and what the run trains on, for checkpoint metadata (megaframe.data.record: a resume
    compares it, evaluate/export/generate read it). The cursor is derived from the step (positions
    [0, step·G) of the (seed, epoch) order are consumed), so resume needs no saved reader state, under any
    dp. `seed`, `global_batch`: train.seed and train.global_batch_size."""
    from megaframe.data.record import mixture, resolved, schedule, sources

    folders = data_folders(d)
    return {
        "kind": d.kind,
        "path": resolved(d.path) if folders and not (d.blend or d.stages) else None,
        "blend": mixture(d.blend),
        "valid_fraction": d.valid_fraction,
        "seed": seed,
        "order": order,
        "stages": schedule(d.stages),
        "sources": sources(folders),
        # the trainer replaces it with Accounting's exact count (a batch size changed at a resume)
        "consumed_samples": step * global_batch,
        "cursor": "derived: global sample position = step * global_batch_size + index in the batch",
    }


def data_changes(d: DataConfig, meta: dict) -> list[tuple[str, str, str, str]]:
    """(config key, recorded, this run's, what it does to the stream) of every change of what the run
    trains on: a switch of data.kind, else what the kind itself compares."""
    from megaframe.data.record import kind_change

    kind = kind_change(d, meta)
    spec = data_kind(d.kind)
    if kind or spec.changes is None:
        return kind
    return spec.changes(d, meta.get("data") or {})


def tokenizer_identity(d: DataConfig) -> dict | None:
    """What a checkpoint records of the tokenizer it was trained with (the first folder's: blended ones
    share it); None for a kind reading no folder or data that cannot be read."""
    from megaframe.data.shards import folder_tokenizer

    folders = data_folders(d)
    return folder_tokenizer(folders[0][1]) if folders else None


def reads_folders(kind) -> bool:
    """Whether a kind (by name, e.g. one a checkpoint recorded) reads prepared folders; False when unknown."""
    spec = DATA_KINDS.get(str(getattr(kind, "value", kind)))
    return spec is not None and spec.folders is not None


def _build_prepared(d: DataConfig, seq: int, vocab: int, seed: int, global_batch: int, split: str):
    from megaframe.data.dataset import PreparedData
    from megaframe.data.mixture import BlendedData
    from megaframe.data.record import resolved
    from megaframe.data.stages import StagedData

    if d.stages and split == "train":
        # the union in first-seen order, keyed by the resolved folder: `x` and `x/` are one dataset
        paths = dict.fromkeys(resolved(b.path) for s in d.stages for b in s.blend)
        parts = {p: PreparedData(p, seq, split, d.valid_fraction) for p in paths}
        return StagedData(parts, d.stages, global_batch, seed)
    # validation of a stages run: the last stage's mixture (the data the run ends on)
    blend = d.stages[-1].blend if d.stages else d.blend
    if not blend:
        return PreparedData(d.path, seq, split, d.valid_fraction)
    parts = [PreparedData(b.path, seq, split, d.valid_fraction) for b in blend]
    return BlendedData(parts, [b.weight for b in blend], seed)


def _build_synthetic(d: DataConfig, seq: int, vocab: int, seed: int, global_batch: int, split: str):
    from megaframe.data.dataset import SyntheticData

    # validation: the same generator under another seed, never seen in training
    return SyntheticData(vocab, seq, seed if split == "train" else seed + 1_000_003)


def _prepared_label(d: DataConfig) -> str:
    """data.name only where it names this data (the demo group's name: demo stays on when data.path points
    at another corpus), else the prepared folder; a blend's or stages' folder names."""
    from pathlib import Path

    from megaframe.config.schema import CONF_DIR

    if d.blend:
        return f"blend of {len(d.blend)} ({', '.join(Path(b.path).name for b in d.blend)})"
    if d.stages:
        each = " -> ".join("+".join(Path(b.path).name for b in s.blend) for s in d.stages)
        return f"{len(d.stages)} stages ({each})"
    demo = (CONF_DIR.parent / "data" / "demo" / "prepared").resolve()
    if d.name == "demo" and Path(d.path).resolve() != demo:
        return str(d.path)
    return f"{d.name} ({d.path})"


def _prepared_folders(d: DataConfig) -> list[tuple[str, str]]:
    from megaframe.data.shards import dataset_paths

    return dataset_paths(d)


def _prepared_changes(d: DataConfig, old: dict) -> list[tuple[str, str, str, str]]:
    from megaframe.data.record import prepared_changes

    return prepared_changes(d, old, dataset_folders=_prepared_folders(d))


register(
    DataKindSpec(
        name="prepared",
        build=_build_prepared,
        label=_prepared_label,
        folders=_prepared_folders,
        changes=_prepared_changes,
    )
)
register(
    DataKindSpec(
        name="synthetic",
        build=_build_synthetic,
        label=lambda d: "synthetic",
        endless=True,
        own_valid=True,
    )
)
