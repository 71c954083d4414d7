"""scripts/import_hf.py refuses an HF folder it cannot import faithfully (exit 2, one line naming the tensor):
a truncated model.safetensors, a weight the folder lacks (transformers would initialise it at random; only a
tied head may be absent) and a NaN/inf weight. Real transformers folders and safetensors files, offline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.helpers import run

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("import_hf", ROOT / "scripts" / "import_hf.py")
import_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_hf)


def hf_folder(path: Path, tied: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).save_pretrained(str(path))
    return path


def edit(folder: Path, change) -> None:
    """Rewrite model.safetensors with `change(tensors)`
    applied (a real file, as a broken upload leaves it)."""
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def refused(folder: Path, out: Path, capsys, *words: str) -> None:
    capsys.readouterr()
    assert import_hf.main([str(folder), str(out), "data=synthetic"]) == 2
    err = capsys.readouterr().err
    # transformers' own progress bar and load report may come first: the verdict is one line
    lines = [ln for ln in err.splitlines() if "megaframe: error:" in ln]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err
    assert not (out / "latest").exists()


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return hf_folder(tmp_path_factory.mktemp("hf") / "untied", tied=False)


def copy(src: Path, dest: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dest))


def test_a_truncated_safetensors_is_one_line(untied, tmp_path):
    folder = copy(untied, tmp_path / "hf")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    # a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the script's refusal
    res = run(
        [sys.executable, "scripts/import_hf.py", str(folder), str(tmp_path / "ck"), "data=synthetic"],
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "megaframe: error:" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "ck" / "latest").exists()


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_a_missing_weight_is_refused_naming_it(untied, tmp_path, capsys, name):
    folder = copy(untied, tmp_path / "hf")
    edit(folder, lambda t: t.pop(name))
    refused(folder, tmp_path / "ck", capsys, name)


def test_a_non_finite_weight_is_refused_naming_it(untied, tmp_path, capsys):
    folder = copy(untied, tmp_path / "hf")
    name = "model.layers.0.mlp.up_proj.weight"

    def poison(t):
        t[name][3, 5] = float("nan")

    edit(folder, poison)
    refused(folder, tmp_path / "ck", capsys, name, "NaN")


def test_a_tied_head_may_be_absent(tmp_path):
    folder = hf_folder(tmp_path / "tied", tied=True)
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    assert import_hf.main([str(folder), str(tmp_path / "ck"), "data=synthetic"]) == 0
