"""Generation: greedy with and without the cache agree (the cached logits equal the full forward's for
every family: tests/unit/models/test_family_conformance.py), seeded sampling repeats, the CLI's stdout is
prompt + text only, and evaluate prints loss and perplexity. Tiny models in one process."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaframe.checkpoint import sharded
from megaframe.config import load_config
from megaframe.inference.decode import generate
from megaframe.inference.sampling import SamplingConfig, next_token
from megaframe.parallel.mesh import single_process_mesh
from tests.e2e.helpers import run
from tests.forms import build_model

ROOT = Path(__file__).resolve().parents[3]
TINY = [
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.seq_length=32",
    "model.vocab_size=384",
    "model.init_std=0.1",
]
MODELS = {
    "llama": ["model=gpt_tiny", "model.num_attention_heads=4", "model.num_query_groups=2"],
}


class WeightsOnly:
    def logical_state(self, p) -> dict:
        return {}


def tiny_model(name: str):
    cfg = load_config(MODELS[name] + TINY, world_size=1, check_data=False)
    return cfg, build_model(cfg, single_process_mesh()).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A committed checkpoint of a tiny Llama whose data.path holds a 360-piece sentencepiece tokenizer."""
    from megaframe.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("gen")
    text = [f"Line {i}: the quick brown fox jumps over {i * 7} lazy dogs." for i in range(300)]
    (d / "data").mkdir()
    train_tokenizer(text, 360, d / "data" / "tokenizer", num_threads=1)
    cfg, model = tiny_model("llama")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(d / "data")))
    sharded.save(
        d / "ckpt", 3, model, WeightsOnly(), single_process_mesh(), {"config": dataclasses.asdict(cfg)}
    )
    return d


def test_greedy_with_and_without_cache_and_seeded_sampling():
    cfg, model = tiny_model("llama")
    prompt = [5, 17, 42, 9]
    greedy = SamplingConfig(temperature=0)
    a = generate(model, prompt, 20, greedy, 360)
    b = generate(model, prompt, 20, greedy, 360, use_cache=False)
    assert a.tokens == b.tokens and len(a.tokens) == 20 and max(a.tokens) < 360
    s = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, seed=11)
    one, two = generate(model, prompt, 20, s, 360), generate(model, prompt, 20, s, 360)
    other = generate(model, prompt, 20, dataclasses.replace(s, seed=12), 360)
    assert one.tokens == two.tokens and one.tokens != other.tokens
    # the sequence ends at seq_length
    assert generate(model, list(range(1, 30)), 20, greedy, 360).stopped == "seq_length"


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 9.0]])
    gen = torch.Generator().manual_seed(0)
    picks = {int(next_token(logits, SamplingConfig(1.0, top_k=2), 5, gen)) for _ in range(200)}
    assert picks == {0, 1}  # index 5 is beyond the vocabulary: never chosen
    p = torch.softmax(logits[:, :5], -1)[0]
    top_p = float(p[0] + 0.5 * p[1])  # nucleus holds tokens 0 and 1 only
    picks = {int(next_token(logits, SamplingConfig(1.0, top_p=top_p), 5, gen)) for _ in range(200)}
    assert picks == {0, 1}


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command as a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the
    command's output and exit code, not the interpreter's start."""
    return run([sys.executable, *args], timeout=120)


def test_cli_streams_prompt_and_text_only(run_dir):
    res = cli(
        "-m",
        "megaframe.generate",
        str(run_dir / "ckpt"),
        "--prompt",
        "the quick",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("the quick") and res.stdout.count("\n") == 1
    assert "tokens/s" in res.stderr and "temperature 0.0" in res.stderr
    bad = cli("-m", "megaframe.generate", str(run_dir / "nothing"), "--prompt", "x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such checkpoint" in bad.stderr


def test_evaluate_prints_loss_and_perplexity(run_dir):
    res = cli(
        "-m",
        "megaframe.evaluate",
        str(run_dir / "ckpt"),
        "data=synthetic",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "2",
    )
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    loss = float(line.split("loss ")[1].split()[0])
    ppl = float(line.split("perplexity ")[1].split()[0])
    assert abs(math.exp(loss) - ppl) / ppl < 1e-3 and "256 tokens" in line  # 2 batches x 4 x 32


def test_seeded_sampling_draws_one_stream_per_prompt(run_dir, tmp_path, capsys):
    """--seed with several prompts: each prompt samples from its own (seed, index) stream, so three equal
    prompts get three continuations (one stream restarted per prompt repeated them), the same every run,
    and the first prompt's text is what a single prompt with that seed gives."""
    from megaframe.generate import main

    (tmp_path / "prompts.txt").write_text("the quick\nthe quick\nthe quick\n")
    args = [str(run_dir / "ckpt"), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "12"]
    args += ["--temperature", "1.0", "--seed", "7"]
    assert main(args) == 0
    texts = capsys.readouterr().out.splitlines()
    assert len(texts) == 3 and len(set(texts)) == 3, texts
    assert main(args) == 0 and capsys.readouterr().out.splitlines() == texts
    one = [str(run_dir / "ckpt"), "--prompt", "the quick", *args[3:]]
    assert main(one) == 0 and capsys.readouterr().out.splitlines() == texts[:1]
    # a seed beyond the generator's 64 bits: one line before any output (it failed after the first prompt)
    assert main([*args[:-1], str(2**64)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "--seed 18446744073709551616 must be" in out.err
