"""Tokenizers: train a sentencepiece byte-fallback BPE model, or load an existing one (a sentencepiece
.model file or a transformers tokenizer folder, offline); encode in batches, decode, hash.

Choices, and why:
- BPE with byte_fallback: any UTF-8 input encodes (unseen characters become <0xNN> byte pieces), so a
  model trained on English never maps text to <unk>.
- identity normalization, no whitespace squeezing: decode(encode(text)) == text, newlines included,
  which is what a pretraining corpus wants (the model sees the text exactly as written).
- an explicit </s> (eos) piece and no <s>/<pad>: documents are joined by eos in the token stream.
- determinism: a fixed sentencepiece seed for the sentence sampling, so training twice on the same
  text gives a byte-identical model (the prepared data's tokenizer_sha256 is then reproducible).
- hard_vocab_limit off: a tiny corpus that cannot fill vocab_size gives a smaller vocabulary instead
  of an error; callers must read `Tokenizer.vocab_size`, not assume the requested size.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import sentencepiece as spm

UNK_ID, EOS_ID = 0, 1  # fixed ids; no bos or pad: documents are joined by eos
MAX_SENTENCE_CHARS = 16384
"""Training "sentences" longer than this are cut into pieces: sentencepiece silently drops any sentence
over max_sentence_length bytes, which would hide long documents (jsonl web pages) from training."""
MAX_SENTENCE_BYTES = 4 * MAX_SENTENCE_CHARS  # a UTF-8 character is at most 4 bytes


T = TypeVar("T")

THREAD_TRIES = 4
"""sentencepiece starts threads (even for num_threads=1) and reports a refused thread creation (EAGAIN:
the host's process or thread limit reached under load) as a RuntimeError; the work is retried this many
times in all, with a growing pause, before it counts as a failure."""
THREAD_PAUSE_S = 0.5
"""The first pause before a try again (then doubled): a loaded host frees threads within seconds."""


class TokenizerError(ValueError):
    """Tokenizer training failed for a reason in the input (too small a vocabulary, no text)."""


def _no_thread(e: BaseException) -> bool:
    """Whether sentencepiece failed because the system refused it a thread (EAGAIN), not for its input."""
    return os.strerror(errno.EAGAIN) in str(e)


def retry_threads(work: Callable[[], T], tries: int = THREAD_TRIES) -> T:
    """work(), again after a pause (0.5, 1, 2 s) while sentencepiece is refused a thread; work must be
    repeatable (its input not consumed by a failed try)."""
    for k in range(tries):
        try:
            return work()
        except RuntimeError as e:
            if not _no_thread(e) or k == tries - 1:
                raise
            time.sleep(THREAD_PAUSE_S * 2**k)
    raise AssertionError("unreachable")


class Tokenizer:
    """A loaded sentencepiece model; encode takes a batch so sentencepiece can use all cores."""

    kind = "sentencepiece"

    def __init__(self, processor: spm.SentencePieceProcessor):
        self.sp = processor

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        return cls(spm.SentencePieceProcessor(model_file=str(path)))

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        return int(self.sp.eos_id())

    def encode(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Token ids of each text (no eos appended: the caller decides document boundaries)."""
        texts = list(texts)
        threads = num_threads or os.cpu_count() or 1
        return retry_threads(lambda: self.sp.encode(texts, out_type=int, num_threads=threads))

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer:
    """A transformers tokenizer folder (tokenizer.json / tokenizer_config.json ...), loaded offline.

    Documents are encoded without special tokens; the eos token (which the tokenizer must have) is
    appended by the caller, as for sentencepiece.
    """

    kind = "transformers"

    def __init__(self, path: str | Path):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we parallelize over processes
        from megaframe.quiet import quiet_optional_imports

        quiet_optional_imports()
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tok.eos_token_id is None:
            raise TokenizerError(f"{path}: the tokenizer has no eos token (set eos_token in its config)")
        # documents are encoded whole, never truncated: no "Token indices sequence length is longer than the
        # specified maximum" warning per long document (the model's context length is not a document limit)
        self.tok.model_max_length = int(1e30)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)  # added tokens included, unlike tok.vocab_size

    @property
    def eos_id(self) -> int:
        return int(self.tok.eos_token_id)

    def encode(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        # split_special_tokens: a literal "</s>" in a document is text, not a document boundary
        return self.tok(
            list(texts), add_special_tokens=False, split_special_tokens=True, return_attention_mask=False
        )["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(path: str | Path) -> Tokenizer | HFTokenizer:
    """A sentencepiece model file or a transformers tokenizer folder; TokenizerError when it is neither."""
    path = Path(path)
    try:
        if path.is_dir():
            return HFTokenizer(path)
        if path.is_file():
            return Tokenizer.load(path)
    except TokenizerError:
        raise
    # what a bad tokenizer raises: sentencepiece a RuntimeError (bad model) or OSError; transformers an
    # OSError (missing files), ValueError (bad JSON, unknown kind) or KeyError (a config without a field)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise TokenizerError(f"{path}: cannot load the tokenizer ({_one_line(e)})") from e
    raise TokenizerError(f"{path} does not exist")


def tokenizer_sha256(path: str | Path) -> str:
    """Content hash of a tokenizer file, or of a folder's files (sorted relative names and bytes)."""
    path = Path(path)
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        # names and contents: a renamed file changes the hash; \0 keeps "a"+"bc" apart from "ab"+"c"
        h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for start in range(0, len(text), MAX_SENTENCE_CHARS):
            yield text[start : start + MAX_SENTENCE_CHARS]


def _one_line(e: BaseException) -> str:
    """sentencepiece errors read 'INTERNAL: src/x.cc(638) [check] message'; keep the message."""
    msg = " ".join(str(e).split())
    return re.sub(r"^[A-Z_]+: \S+\(\d+\) \[[^\]]*\]\s*", "", msg) or type(e).__name__


def train_tokenizer(
    text_iterator: Iterable[str] | Callable[[], Iterable[str]],
    vocab_size: int,
    model_prefix: str | Path,
    *,
    seed: int = 1234,
    max_sentences: int = 1_000_000,
    character_coverage: float = 0.9995,
    num_threads: int | None = None,
) -> Path:
    """Train a byte-fallback BPE model on the texts; writes `{model_prefix}.model` and returns its path.

    At most `max_sentences` training sentences are kept (a seeded reservoir sample when there are more),
    which bounds the trainer's memory on a large corpus. Raises TokenizerError on bad input.
    The texts may be a function giving them anew: then (or for a list) a training refused a thread by a
    loaded host is retried (retry_threads); a one-pass iterator is consumed by the first try.
    """
    if callable(text_iterator):
        texts, tries = text_iterator, THREAD_TRIES
    else:  # a list can be read again; a one-pass iterator cannot
        texts = lambda: text_iterator  # noqa: E731
        tries = THREAD_TRIES if isinstance(text_iterator, (list, tuple)) else 1
    spec = (vocab_size, seed, max_sentences, character_coverage, num_threads)
    try:
        model = retry_threads(lambda: _train(texts(), *spec), tries)
    except RuntimeError as e:
        raise TokenizerError(f"tokenizer training failed: {_one_line(e)}") from e
    if not model:
        raise TokenizerError("tokenizer training produced no model (no text?)")
    path = Path(f"{model_prefix}.model")
    path.write_bytes(model)
    return path


def _train(
    texts: Iterable[str],
    vocab_size: int,
    seed: int,
    max_sentences: int,
    character_coverage: float,
    num_threads: int | None,
) -> bytes:
    """One sentencepiece training into memory: the model's bytes (empty when it wrote none)."""
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # the reservoir sampling is the only randomness
    spm.SentencePieceTrainer.train(
        # trained into memory: the .model file is written only on success, never half
        sentence_iterator=_sentences(texts),
        model_writer=model,
        model_type="bpe",
        vocab_size=int(vocab_size),
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        # dummy prefix: a text's first word gets the same piece as mid-text; split digits: numbers
        # tokenize digit by digit, consistently
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=UNK_ID,
        eos_id=EOS_ID,
        bos_id=-1,
        pad_id=-1,
        eos_piece="</s>",
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2,
    )
    return model.getvalue()
