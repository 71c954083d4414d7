"""sentencepiece on a loaded host: a thread it is refused (EAGAIN, "Resource temporarily unavailable") is
retried, in training (a list or a function giving the texts anew: prepare's sample) and in encoding; a
failure for the input is not retried. The refusal is injected: no timing."""

from __future__ import annotations

import errno
import os

import pytest
import sentencepiece as spm

from megaframe.data import tokenizer as tk
from megaframe.data.prepare import main as prepare_main
from tests.unit.data.test_prepare import paragraphs, write_text_corpus

REFUSED = f"Internal: src/thread_pool.cc(12) [pthread_create] {os.strerror(errno.EAGAIN)}"
TEXT = [f"Line {i}: the quick brown fox jumps over {i * 7} lazy dogs." for i in range(120)]


@pytest.fixture()
def refuse_first(monkeypatch):
    """The trainer is refused a thread on its first call (after reading every sentence, as sentencepiece
    does); returns the sentences each call read."""
    real, seen = spm.SentencePieceTrainer.train, []

    def train(**kw):
        sentences = list(kw.pop("sentence_iterator"))
        seen.append(sentences)
        if len(seen) == 1:
            raise RuntimeError(REFUSED)
        return real(sentence_iterator=iter(sentences), **kw)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", train)
    monkeypatch.setattr(tk, "THREAD_PAUSE_S", 0.0, raising=False)
    return seen


def test_training_refused_a_thread_is_retried(tmp_path, refuse_first):
    path = tk.train_tokenizer(TEXT, 300, tmp_path / "tok", num_threads=1)
    assert tk.Tokenizer.load(path).vocab_size > 256 and len(refuse_first) == 2
    assert refuse_first[0] == refuse_first[1]  # the same sentences again


def test_prepare_retries_its_tokenizer_training_on_the_same_sample(tmp_path, refuse_first, capsys):
    src = write_text_corpus(tmp_path / "src", paragraphs(20))
    rc = prepare_main(
        [f"data.source={src}", f"data.path={tmp_path / 'out'}", "data.vocab_size=400", "data.num_workers=1"]
    )
    assert rc == 0, capsys.readouterr().err
    assert len(refuse_first) == 2 and refuse_first[0] == refuse_first[1] and refuse_first[0]


def test_a_failure_for_the_input_is_not_retried(tmp_path, monkeypatch):
    calls = []

    def train(**kw):
        calls.append(1)
        raise RuntimeError("Internal: src/trainer_interface.cc(1) [!sentences_.empty()] no sentences")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", train)
    with pytest.raises(tk.TokenizerError, match="no sentences"):
        tk.train_tokenizer(TEXT, 300, tmp_path / "tok")
    assert calls == [1]


def test_a_host_refusing_threads_every_time_still_fails_in_one_line(tmp_path, monkeypatch):
    def train(**kw):
        list(kw["sentence_iterator"])
        raise RuntimeError(REFUSED)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", train)
    monkeypatch.setattr(tk, "THREAD_PAUSE_S", 0.0, raising=False)
    with pytest.raises(tk.TokenizerError, match="Resource temporarily unavailable"):
        tk.train_tokenizer(TEXT, 300, tmp_path / "tok")


def test_encoding_refused_a_thread_is_retried(tmp_path, monkeypatch):
    tok = tk.Tokenizer.load(tk.train_tokenizer(TEXT, 300, tmp_path / "tok", num_threads=1))
    want = tok.encode(["the quick brown fox"])
    real, calls = tok.sp.encode, []

    def encode(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(REFUSED)
        return real(*a, **kw)

    monkeypatch.setattr(tok.sp, "encode", encode)
    monkeypatch.setattr(tk, "THREAD_PAUSE_S", 0.0, raising=False)
    assert tok.encode(["the quick brown fox"]) == want and len(calls) == 2
