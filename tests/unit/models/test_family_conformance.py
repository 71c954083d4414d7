"""What every registered family (megaframe/models/registry.py) must do, run for each of them on its tiny
preset: its check accepts its presets and the load-time inference finds it again; its parameter and FLOP
counters equal `numel` of a meta model; decoding with the cache (the model's own forward with `kv_cache`)
gives the full forward's logits; a family with a transformers class round-trips through it (logits equal
in fp32, the state back exactly). The multi-rank half (tp2.sp.pp2 equal to one process) is
tests/distributed/models/test_family_conformance.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import megaframe
from megaframe.checkpoint import hf
from megaframe.config import load_config
from megaframe.model.parallelize import whole_model
from megaframe.models.registry import FAMILIES, family, infer, spec_of
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build_model
from tests.unit.checkpoint.test_hf_interop import make_checkpoint

NAMES = list(FAMILIES)
SMALL = ["data=synthetic", "model.num_layers=2", "model.seq_length=32", "model.vocab_size=256"]


def tiny(name: str, *more: str):
    return load_config([f"model={family(name).tiny}", *SMALL, *more], world_size=1, check_data=False)


def perturbed(cfg):
    """The tiny model, every norm and bias off its init (a mapping that swaps them shows in the logits)."""
    model = build_model(cfg, single_process_mesh()).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def ids(cfg, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_length), generator=gen)


@pytest.mark.parametrize("name", NAMES)
def test_presets_pass_the_check_and_inference_finds_the_family(name):
    spec = family(name)
    for preset in spec.presets:
        m = load_config([f"model={preset}", "data=synthetic"], world_size=1, check_data=False).model
        assert m.family == name and spec.check(m) == [], preset
        # a config or checkpoint from before model.family gets the same family at load
        assert infer(dataclasses.replace(m, family=None)) is spec, preset


@pytest.mark.parametrize("name", NAMES)
def test_counters_equal_numel_on_a_meta_model(name):
    m = tiny(name).model
    spec = spec_of(m)
    model = whole_model(m, "meta")
    assert spec.total_params(m) == sum(p.numel() for p in model.parameters())
    # the matmul weights one token meets: every block matrix (an expert's top_k / E of the time), the head
    # (once more per multi-token-prediction depth, with its matrices)
    blocks = [*model.layers.named_parameters(), *(model.mtp.named_parameters() if model.mtp else [])]
    active = sum(
        p.numel() * m.moe_top_k // m.num_experts if ".experts." in n else p.numel()
        for n, p in blocks
        if p.ndim >= 2
    )
    head = (1 + m.mtp_num_layers) * m.vocab_size * m.hidden_size
    assert spec.matmul_params(m) == active + head
    # QK^T at the query/key width, PV at the value width (both the head dim outside MLA)
    widths = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim if m.mla else 2 * m.head_dim
    core = 6 * (m.num_layers + m.mtp_num_layers) * m.seq_length * m.num_attention_heads * widths
    assert spec.flops_per_token(m) == 6 * (active + head) + core


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_equals_the_full_forward(name):
    from megaframe.inference.kv import forward_cached, new_cache

    cfg = tiny(name)
    model = perturbed(cfg)
    ids_BS = ids(cfg)[:, :20]
    with torch.no_grad():
        ref_BSV = model(ids_BS)
    cache = new_cache(model)
    parts = [forward_cached(model, ids_BS[:, :7], cache)]  # prefill 7, then 3, then one at a time
    parts.append(forward_cached(model, ids_BS[:, 7:10], cache))
    parts += [forward_cached(model, ids_BS[:, i : i + 1], cache) for i in range(10, 20)]
    assert cache.length == 20
    err = (torch.cat(parts, dim=1) - ref_BSV).abs().max().item()
    assert err < 1e-5, err


@pytest.mark.parametrize("name", NAMES)
def test_hf_round_trip(name):
    spec = family(name)
    cfg = tiny(name)
    model = perturbed(cfg)
    state = {n: p.detach() for n, p in model.named_parameters()}
    if spec.hf_architecture is None:  # no transformers class computes it: refused in one line
        with pytest.raises(ValueError, match=f"family={name}"):
            hf.to_hf(cfg.model, state)
        return
    hf_cfg, sd = hf.to_hf(cfg.model, state)
    hf_model = hf.build_hf_model(hf_cfg, sd)
    assert type(hf_model).__name__ == spec.hf_architecture
    x = ids(cfg)
    with torch.no_grad():
        want = model(x)
        assert (hf_model(x).logits - want).abs().max().item() <= 1e-4
    # the export's own tensors back exactly, multi-token-prediction depths included (DeepSeek's files carry
    # them after the last layer)
    _, whole = spec.from_hf(hf_cfg, sd)
    assert whole.keys() == state.keys() and all(torch.equal(whole[k], state[k]) for k in state)
    # through transformers' model: what its class computes (it holds no MTP depth)
    fields, back = hf.from_hf(hf_model)
    assert fields["family"] == name
    state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    # the imported config builds the same function: its model, holding the state back, gives the logits
    again = whole_model(dataclasses.replace(cfg.model, **fields)).eval()
    again.load_state_dict(back, strict=False)
    with torch.no_grad():
        assert torch.equal(again(x), want)


def test_a_config_its_family_refuses_names_each_field_and_the_fitting_family():
    from megaframe.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny("llama", "model.norm=layernorm", "model.num_experts=4")
    msg = str(e.value)
    assert "model.family=llama" in msg and "model.norm=layernorm" in msg and "model.num_experts=4" in msg
    assert "fit model.family=custom" in msg and "\n" not in msg
    # named as what it is, it trains (and counts) as the configurable block
    assert tiny(
        "llama", "model.norm=layernorm", "model.num_experts=4", "model.family=custom"
    ).model.num_experts
    with pytest.raises(ConfigError, match="model.family=mistral: unknown model family 'mistral'"):
        tiny("llama", "model.family=mistral")


def test_a_checkpoint_from_before_the_key_resumes_as_its_family(tmp_path):
    """A MoE checkpoint recorded without model.family resumes as a mixtral, not as the default preset's
    llama (config/adopt.py), and loads with its blocks."""
    make_checkpoint(tmp_path / "ck", ["model=moe_tiny"])
    meta_path = tmp_path / "ck" / "step_00000003" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]["model"]["family"]
    meta_path.write_text(json.dumps(meta))
    resume = f"checkpoint.resume={tmp_path / 'ck' / 'step_00000003'}"
    cfg = load_config([resume, "data=synthetic"], world_size=1, check_data=False)
    assert cfg.model.family == "mixtral" and cfg.model.num_experts == 8
    assert megaframe.load_model(str(tmp_path / "ck")).cfg.family is None  # inferred where it builds


def test_where_to_add_a_family_names_paths_that_exist():
    """docs/architecture.md's "Where to add: A model family": every path it names is there (the folder for
    every registered family)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "architecture.md").read_text()
    entry = text[text.index("- **A model family**") : text.index("- **A pipeline schedule**")]
    paths = [p for p in re.findall(r"`([^`\s]+)`", entry) if "/" in p]
    assert len(paths) >= 10, paths
    for p in paths:
        for name in NAMES if "<family>" in p else [None]:
            where = root / p.replace("<family>", name or "")
            assert where.exists(), f"docs/architecture.md names {p}: {where} does not exist"
    for name in NAMES:
        assert (root / "megaframe" / "models" / name / "spec.py").is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_fp8_switches_every_block_linear_and_computes_the_bf16_function(name):
    """train.precision=fp8 reaches every linear of the family's own block (a block whose projections are
    not megaframe's parallel linears would silently stay bf16) and computes what bf16 does, to float8's
    rounding: the loss of one batch within 2 %, not bit-equal."""
    from megaframe.layers.fp8 import Fp8Gemm
    from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear

    losses, mesh = {}, single_process_mesh()
    for precision in ("bf16", "fp8"):
        cfg = tiny(name, f"train.precision={precision}", "model.hidden_size=64", "model.vocab_size=256")
        model = build_model(cfg, mesh)
        x = ids(cfg)
        with torch.no_grad():
            losses[precision] = model(x, torch.roll(x, -1, dims=1)).float().mean().item()
    # the blocks' (and MTP depths') linears; the head follows train.fp8_head (off by default)
    blocks = [model.layers] + ([model.mtp] if getattr(model, "mtp", None) is not None else [])
    kinds = (ColumnParallelLinear, RowParallelLinear)
    linears = {n: m for b in blocks for n, m in b.named_modules() if isinstance(m, kinds)}
    bf16 = [n for n, m in linears.items() if not isinstance(getattr(m, "gemm", None), Fp8Gemm)]
    assert linears and bf16 == [], bf16
    rel = abs(losses["fp8"] - losses["bf16"]) / abs(losses["bf16"])
    assert 0 < rel < 0.02, losses
