"""prepare's tokenizer: put it into the partial folder, kept from an interrupted run, copied from
data.tokenizer, or trained with sentencepiece on a sample of the corpus (megaframe.data.prepare)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

from megaframe.config.schema import DataConfig, DocSplit
from megaframe.data.prepare.sources import PrepareError, SourceFile, sample_documents
from megaframe.data.tokenizer import TokenizerError, load_tokenizer, train_tokenizer

TOKENIZER_SEED = 1234
"""Fixed (not train.seed): the tokenizer, hence the prepared data, must not change with a training seed."""


def put_tokenizer(d: DataConfig, files: list[SourceFile], work: Path, cache: str) -> str:
    """Put the tokenizer into `work` (kept from an interrupted run, copied, or trained); returns its name."""
    if d.tokenizer:
        src = Path(d.tokenizer)
        name = "tokenizer" if src.is_dir() else "tokenizer.model"
        if not (work / name).exists():
            tmp = work / f"{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp) if src.is_dir() else shutil.copyfile(src, tmp)
            # copied under a temporary name: a crash mid-copy never leaves a partial tokenizer under its name
            os.rename(tmp, work / name)
        try:
            load_tokenizer(work / name)
        except TokenizerError as e:
            raise PrepareError(f"data.tokenizer={d.tokenizer}: {e}") from e
        return name
    if (work / "tokenizer.model").is_file():
        return "tokenizer.model"

    def sample() -> Iterator[str]:  # deterministic: a retried training reads the very same documents
        return sample_documents(files, d.text_key, cache, d.tokenizer_sample_bytes, DocSplit(d.split).value)

    docs = sample()
    total = sum(f.size for f in files)
    print(
        f"megaframe: prepare: training a tokenizer (vocab {d.vocab_size}) on "
        f"{min(d.tokenizer_sample_bytes or total, total) / 1e6:,.1f} of {total / 1e6:,.1f} MB",
        flush=True,
    )
    first = next(docs, None)
    if first is None:
        raise PrepareError(f"data.source={d.source}: the files hold no text")
    try:
        # one thread: sentencepiece's result depends on its thread count (and threads barely speed it
        # up), so the same corpus gives the same tokenizer on every machine
        # the first try streams the sample opened above; a try again (a host refusing sentencepiece a
        # thread under load) samples anew
        fresh = iter([_chain(first, docs)])
        path = train_tokenizer(
            lambda: next(fresh, None) or sample(),
            d.vocab_size,
            work / "tokenizer.tmp",
            seed=TOKENIZER_SEED,
            num_threads=1,
        )
    except TokenizerError as e:
        raise PrepareError(f"data.vocab_size={d.vocab_size}: {e}") from e
    # renamed into place only when training finished: a resumed run reuses a whole tokenizer or trains anew
    os.rename(path, work / "tokenizer.model")
    return "tokenizer.model"


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest
