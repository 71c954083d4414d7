"""HF interop: megaframe checkpoint -> transformers folder -> megaframe checkpoint, logits equal both ways
(fp32, max abs diff < 1e-4); the exported tokenizer encodes like sentencepiece; train.py continues from an
imported checkpoint; bad input exits 2. Tiny models, offline, well under a minute."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import megaframe
from megaframe.checkpoint import hf, sharded
from megaframe.config import load_config
from megaframe.data.order import ORDER
from megaframe.parallel.mesh import single_process_mesh
from tests.e2e import helpers
from tests.forms import build_model
from tests.unit.hf_scripts import export_hf, import_hf

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
LLAMA = ["model=gpt_tiny", "model.num_attention_heads=4", "model.num_query_groups=2"]
# the commands end to end, on variants of the families' tiny presets (each family's own round trip, on
# its preset: tests/unit/models/test_family_conformance.py)
CASES = {  # name -> overrides
    "llama_mha_tied": ["model=gpt_tiny", "model.num_query_groups=null", "model.tie_embeddings=true"],
    "llama_bias_theta": ["model=gpt_tiny", "model.bias=true", "model.rope_theta=500000.0"],
    "gpt2_untied": ["model=gpt2_tiny", "model.tie_embeddings=false"],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A data.path holding a sentencepiece tokenizer.model smaller than the model's 384 rows."""
    from megaframe.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("data")
    text = [
        f"Line {i}: the quick brown fox jumps over {i * 7} lazy dogs.\n  Ünïcode ☃ and tabs\tend."
        for i in range(300)
    ]
    train_tokenizer(text, 360, d / "tokenizer", num_threads=1)
    return d


def make_checkpoint(root: Path, overrides: list[str], data_path: str = ""):
    """A committed step_00000003 of a tiny model whose norms and biases are perturbed too (so a swapped
    norm or bias mapping shows up in the logits). Returns (cfg, model)."""
    cfg = load_config(overrides + TINY, world_size=1, check_data=False)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data_path))
    mesh = single_process_mesh()
    model = build_model(cfg, mesh).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    meta = {"consumed_samples": 0, "config": dataclasses.asdict(cfg)}
    sharded.save(root, 3, model, import_hf.WeightsOnly(), mesh, meta)
    return cfg, model


def ids(cfg, batch: int = 2) -> torch.Tensor:
    return torch.randint(
        0, cfg.model.vocab_size, (batch, cfg.model.seq_length), generator=torch.Generator().manual_seed(3)
    )


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_logits(tmp_path, case):
    from transformers import AutoModelForCausalLM

    cfg, model = make_checkpoint(tmp_path / "ckpt", CASES[case])
    assert export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    want = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[hf.family(cfg.model)]
    assert type(hf_model).__name__ == want
    assert hf_model.config.vocab_size == cfg.model.vocab_size
    x = ids(cfg)
    with torch.no_grad():
        ref = model(x)
        err_export = (hf_model(x).logits - ref).abs().max().item()
    assert err_export < 1e-4, err_export

    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "back"), "data=synthetic"]) == 0
    back = megaframe.load_model(str(tmp_path / "back"))
    with torch.no_grad():
        err_import = (back(x) - ref).abs().max().item()
    assert err_import < 1e-4, err_import
    assert (tmp_path / "back" / "latest").read_text().strip() == "step_00000000"
    meta = sharded.read_metadata(tmp_path / "back" / "step_00000000")
    assert meta["step"] == 0 and not any(k.startswith("optim/") for k in meta["tensors"])
    for k in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "kv_heads",
        "ffn_hidden_size",
        "vocab_size",
        "tie_embeddings",
        "bias",
        "rope_theta",
        "norm_eps",
        "seq_length",
    ):
        assert getattr(back.cfg, k) == getattr(cfg.model, k), k


def test_tokenizer_exported_and_bf16(tmp_path, tokenizer_dir):
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, model = make_checkpoint(tmp_path / "ckpt", LLAMA, str(tokenizer_dir))
    out = tmp_path / "hf"
    assert export_hf.main([str(tmp_path / "ckpt" / "step_00000003"), str(out), "--dtype", "bf16"]) == 0
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    assert len(tok) == sp.get_piece_size() < cfg.model.vocab_size
    for text in ["Line 12: the quick brown fox", " two  spaces\tand\nnewline ☃ 日本 </s>", "1234567", ""]:
        assert tok(text)["input_ids"] == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    hf_model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert hf_model.config.eos_token_id == sp.eos_id()
    assert hf_model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hf_model.model.embed_tokens.weight.shape[0] == cfg.model.vocab_size  # all rows kept

    assert (
        import_hf.main([str(out), str(tmp_path / "back"), "data=synthetic"]) == 0
    )  # bf16 weights come back fp32
    back_tok = AutoTokenizer.from_pretrained(str(tmp_path / "back" / "hf_tokenizer"), local_files_only=True)
    assert back_tok("Line 12: the quick ☃")["input_ids"] == sp.encode("Line 12: the quick ☃")
    back = megaframe.load_model(str(tmp_path / "back"))
    assert back.embed.weight.dtype == torch.float32
    assert torch.equal(back.embed.weight, model.embed.weight.detach().to(torch.bfloat16).float())


def test_train_continues_from_imported(tmp_path):
    """train.py resumes the imported step-0 checkpoint: its
    step-1 loss is the HF model's loss on step 1's batch."""
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.forms import build_data, microbatches

    torch.manual_seed(0)
    src = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).eval()
    src.save_pretrained(str(tmp_path / "src"))
    assert import_hf.main([str(tmp_path / "src"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    fields, _ = hf.from_hf(tmp_path / "src")
    args = [
        f"checkpoint.resume={tmp_path / 'ck' / 'step_00000000'}",
        *hf.model_overrides(fields),
        "data=synthetic",
        "train.max_steps=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.log_interval=1",
        "logging.wandb.mode=disabled",
        f"run.dir={tmp_path / 'run'}",
    ]
    # a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the resumed run
    res = helpers.run([sys.executable, "train.py", *args], timeout=120, HF_HUB_OFFLINE="1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "at step 0" in res.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    cfg = load_config(args[1:], world_size=1, check_data=False)
    with torch.no_grad():
        losses = [
            F.cross_entropy(src(x).logits.flatten(0, 1), y.flatten())
            for x, y in microbatches(build_data(cfg), 0, 4, 2, 0, 1, cfg.train.seed)
        ]
    assert abs(rows[0]["loss"] - torch.stack(losses).mean().item()) < 1e-4
    assert megaframe.load_model(str(tmp_path / "run" / "checkpoints")).cfg.num_layers == 2
    # the import and the run continued from it use the documented order (they fell back to the legacy one)
    for folder in (tmp_path / "ck" / "step_00000000", tmp_path / "run" / "checkpoints" / "step_00000002"):
        assert json.loads((folder / "metadata.json").read_text())["data"]["order"] == ORDER, folder


def test_bad_input_exits_2(tmp_path, capsys):
    res = helpers.run(
        [sys.executable, "scripts/export_hf.py", str(tmp_path / "missing"), str(tmp_path / "o")], timeout=60
    )
    assert res.returncode == 2 and res.stderr.strip().startswith("megaframe: error:"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1

    make_checkpoint(tmp_path / "ckpt", ["model=gpt2_tiny"])
    shard = next((tmp_path / "ckpt" / "step_00000003").glob("shard_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    capsys.readouterr()
    for argv in (
        [str(tmp_path / "ckpt" / "step_00000003"), str(tmp_path / "o1")],
        [str(tmp_path / "ckpt"), str(tmp_path / "o2")],
        [str(tmp_path), str(tmp_path / "o3")],
    ):
        assert export_hf.main(argv) == 2, argv
        assert "megaframe: error:" in capsys.readouterr().err
        assert not Path(argv[1]).exists()  # nothing half-written

    # megaframe's configurable block in a combination no transformers class computes
    make_checkpoint(tmp_path / "odd", ["model=gpt_tiny", "model.activation=gelu", "model.family=custom"])
    assert export_hf.main([str(tmp_path / "odd"), str(tmp_path / "o4")]) == 2
    assert "model.family=custom (gpt_tiny) has no transformers counterpart" in capsys.readouterr().err
    assert import_hf.main([str(tmp_path), str(tmp_path / "imp")]) == 2  # not an HF folder
    assert "not a transformers model folder" in capsys.readouterr().err


def test_imported_model_refuses_data_of_another_tokenizer(tmp_path, tokenizer_dir):
    """An import records its tokenizer; data prepared with another one is refused, with one line naming
    both (before: the run trained on ids of the wrong tokenizer); data prepared with it is accepted."""
    from megaframe.config import ConfigError
    from megaframe.data import prepare

    make_checkpoint(tmp_path / "ckpt", LLAMA, str(tokenizer_dir))
    assert export_hf.main([str(tmp_path / "ckpt" / "step_00000003"), str(tmp_path / "hf")]) == 0
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ck"), "data=synthetic"]) == 0
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(
        "\n\n".join(f"Line {i}: the quick brown fox {i * 3}." for i in range(400))
    )
    common = [f"data.source={tmp_path / 'corpus'}", "data.num_workers=1"]
    assert (
        prepare.main(
            common + [f"data.path={tmp_path / 'own'}", f"data.tokenizer={tmp_path / 'ck' / 'hf_tokenizer'}"]
        )
        == 0
    )
    assert prepare.main(common + [f"data.path={tmp_path / 'other'}", "data.vocab_size=300"]) == 0
    fields, _ = hf.from_hf(tmp_path / "hf")
    run = [f"checkpoint.resume={tmp_path / 'ck' / 'step_00000000'}", *hf.model_overrides(fields)]
    with pytest.raises(ConfigError) as info:
        load_config(run + [f"data.path={tmp_path / 'other'}"], world_size=1)
    msg = str(info.value)
    assert "\n" not in msg and "transformers tokenizer of" in msg and "sentencepiece tokenizer of" in msg
    assert "data.tokenizer=" in msg  # names the fix
    assert load_config(run + [f"data.path={tmp_path / 'own'}"], world_size=1).model.vocab_size == 384
