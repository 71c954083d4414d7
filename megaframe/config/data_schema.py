"""The data group of the config schema (data.*): the source and its preparation, the prepared folder or a
blend of them, the stages of a curriculum. Split from megaframe/config/schema.py (which re-exports it) as
model_schema.py is; a leaf module like it (of megaframe it imports only config/choices.py and
config/frozen.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megaframe.config.choices import DataKind, DocSplit
from megaframe.config.frozen import Frozen


@dataclass
class BlendSource(Frozen):
    path: str = ""
    """A folder written by megaframe.data.prepare."""
    weight: float = 1.0
    """Relative share of the training samples (weights are normalized)."""


@dataclass
class DataStage(Frozen):
    until_step: Optional[int] = None
    """This stage ends after this many steps of the run (counted from step 0)."""
    until_tokens: Optional[float] = None
    """Or: it ends once this many training tokens were consumed, rounded up to a whole global batch."""
    blend: list[BlendSource] = field(default_factory=list)
    """The stage's mixture, as data.blend (the stages' datasets must share a tokenizer)."""


DEFAULT_EXTENSIONS = [
    # records
    ".jsonl",
    ".json",
    ".parquet",
    # prose and markup
    ".txt",
    ".md",
    ".markdown",
    ".rst",
    ".tex",
    ".org",
    ".adoc",
    ".html",
    ".htm",
    ".xml",
    ".csv",
    ".tsv",
    # source code and its configuration
    ".py",
    ".pyi",
    ".ipynb",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".cxx",
    ".hpp",
    ".hh",
    ".cu",
    ".cuh",
    ".java",
    ".kt",
    ".scala",
    ".go",
    ".rs",
    ".rb",
    ".php",
    ".js",
    ".jsx",
    ".mjs",
    ".ts",
    ".tsx",
    ".swift",
    ".m",
    ".mm",
    ".cs",
    ".fs",
    ".hs",
    ".ml",
    ".lua",
    ".pl",
    ".r",
    ".jl",
    ".dart",
    ".zig",
    ".nim",
    ".ex",
    ".exs",
    ".erl",
    ".clj",
    ".el",
    ".vim",
    ".sh",
    ".bash",
    ".zsh",
    ".ps1",
    ".sql",
    ".css",
    ".scss",
    ".yaml",
    ".yml",
    ".toml",
    ".ini",
    ".cfg",
    ".proto",
    ".cmake",
    ".mk",
    ".gradle",
    ".bzl",
]
"""data.extensions' default. Any of them may also be gzipped (name.ext.gz)."""


@dataclass
class DataConfig(Frozen):
    name: str = "demo"
    """Dataset label for logs."""
    kind: DataKind = DataKind.prepared
    """prepared (token shards under data.path) | synthetic (deterministic random tokens)."""
    path: str = ""
    """Folder written by megaframe.data.prepare: tokenizer.model, meta.json and token shards."""
    source: str = ""
    """For prepare: a folder or glob of .txt, .jsonl(.gz) or .parquet files."""
    vocab_size: int = 4096
    """For prepare: sentencepiece vocabulary size to train."""
    text_key: str = "text"
    """For prepare: the text field of jsonl / parquet records."""
    tokenizer: str = ""
    """For prepare: reuse this tokenizer (a sentencepiece .model or a transformers tokenizer folder)
    instead of training one; empty = train a sentencepiece BPE of data.vocab_size pieces."""
    tokenizer_sample_bytes: int = 1 << 30
    """For prepare: train the tokenizer on about this many bytes of text spread over the corpus (0 = all)."""
    num_workers: int = 0
    """For prepare: tokenizer processes; 0 = one per CPU core."""
    valid_fraction: float = 0.0
    """Hold out about this fraction of each dataset's tokens for validation (train.eval_interval): whole
    documents in a fixed seeded random order (megaframe.data.dataset.VALID_SEED); training never reads
    them."""
    extensions: list[str] = field(default_factory=lambda: list(DEFAULT_EXTENSIONS))
    """For prepare: the file name endings read from a data.source folder or glob (.jsonl/.json/.parquet as
    records, the rest as plain text); files without any extension are read when their head is text."""
    task: int = 0
    """For prepare: this task's index under data.num_tasks (a Slurm array's SLURM_ARRAY_TASK_ID)."""
    num_tasks: int = 1
    """For prepare: split the work into this many tasks over disjoint parts of the sources, balanced by bytes
    (megaframe.data.prepare.tasks); the last to finish, or `prepare merge`, writes meta.json."""
    split: DocSplit = DocSplit.file
    """For prepare: file = one document per text file (code, web pages); paragraph = one document per
    blank-line separated paragraph (books). jsonl / json / parquet are always one document per record."""
    blend: list[BlendSource] = field(default_factory=list)
    """Train on several prepared datasets mixed by weight, instead of data.path, e.g.
    data.blend='[{path: /data/a, weight: 0.7}, {path: /data/b, weight: 0.3}]'. They must share a tokenizer."""
    document_mask: bool = False
    """Attention only within each sample's own documents (causal within each), positions (RoPE or learned)
    restarting at every document; a document ends at the tokenizer's end-of-document id (synthetic data:
    ids that are multiples of 64). The end token's loss (predicting the next document's first token) is
    kept. Exact under every layout, cp included; CPU: SDPA under a boolean mask, CUDA: FlexAttention
    block masks (megaframe.model.documents, docs/data.md)."""
    stages: list[DataStage] = field(default_factory=list)
    """Mixtures that change during the run, instead of data.blend: a list of {until_step or until_tokens,
    blend}, ends increasing, the last one open-ended; the sampler switches at each boundary, exactly, under
    any dp, and a resume inside a stage continues its stream (megaframe.data.stages)."""
