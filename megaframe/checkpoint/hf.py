"""Hugging Face transformers interop: megaframe full tensors <-> transformers causal LMs, per model family.

The facades here (family, to_hf, from_hf) dispatch to the family adapters registered in
megaframe/models/registry.py (Llama, Qwen3, GPT-2 and Mixtral each in models/<family>/hf.py).

megaframe names and layouts (full, unsharded tensors; D hidden, V vocab rows, S seq_length,
H query heads, K kv heads (num_query_groups), E head dim (kv_channels, else D/H), F ffn_hidden_size):
    embed.weight                     [V, D]
    pos_embed                        [S, D]            (learned positions only)
    layers.{i}.attn_norm.weight/bias [D]               (bias for layernorm only)
    layers.{i}.attn.qkv.weight       [(H+2K)·E, D]     rows [q | k | v]; q = H·E rows head-major, k, v = K·E
    layers.{i}.attn.qkv.bias         [(H+2K)·E]
    layers.{i}.attn.out_proj.weight  [D, H·E]  (+ bias [D])
    layers.{i}.mlp_norm.weight/bias  [D]
    layers.{i}.mlp.up_proj.weight    [2F, D] = [gate | up] (swiglu) or [F, D] (gelu)  (+ bias)
    layers.{i}.mlp.down_proj.weight  [D, F]  (+ bias [D])
    final_norm.weight/bias           [D]
    head.weight                      [V, D]            (untied only)

Llama (rmsnorm, swiglu, rope): q_proj/k_proj/v_proj are the [q | k | v] row blocks as they are (both
use rotate-half RoPE on head-major rows, so no permutation); gate_proj/up_proj the [gate | up] blocks.
GPT-2 (layernorm, gelu-tanh, learned positions, H == K): Conv1D weights are stored [in, out], so
c_attn = qkv.weight.T [D, 3D], c_proj = out_proj.weight.T, c_fc = up_proj.weight.T [D, F],
mlp.c_proj = down_proj.weight.T [F, D]; wpe = pos_embed with n_positions = S.
Mixtral (rmsnorm, swiglu, rope, every block a softmax top-k MoE): attention and norms as Llama; per
layer the router layers.{i}.mlp.router.weight [E, D] is mlp.gate.weight, and the stacked experts
layers.{i}.mlp.experts.up_proj.weight [E, 2F, D] = [gate | up] and down_proj.weight [E, D, F] are
transformers 5's fused mlp.experts.gate_up_proj and mlp.experts.down_proj as they are (transformers 4
names them block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down): converted).
Qwen3: Llama's layout plus layers.{i}.attn.q_norm/k_norm.weight [E] = self_attn.q_norm/k_norm.weight.
Vocabulary: all V embedding rows are exported (the tokenizer may have fewer pieces).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megaframe.config.schema import ModelConfig
from megaframe.quiet import quiet_optional_imports

# before this module's transformers imports: transformers loads torchao, which logs noise
quiet_optional_imports()


def family(m: ModelConfig) -> str:
    """The name of `m`'s family ('llama', 'qwen3', 'gpt2', 'mixtral', ...: models/registry.py): the one
    model.family names, else the one inferred from the config (a config recorded before the key)."""
    from megaframe.models.registry import spec_of

    return spec_of(m).name


def to_hf(
    m: ModelConfig,
    state: dict[str, torch.Tensor],
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
):
    """(transformers config, HF state_dict) for megaframe full tensors `state` (names as in the module doc),
    by `m`'s family adapter. The state_dict omits lm_head.weight when the embeddings are tied (transformers
    ties it itself). ValueError naming what the family's transformers class cannot compute."""
    from megaframe.models.registry import spec_of

    return spec_of(m).to_hf(m, state, eos_token_id, bos_token_id)


def build_hf_model(cfg, sd: dict[str, torch.Tensor]):
    """A transformers causal LM for `cfg`, holding exactly `sd` (strict: every weight must be given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, **_fp32())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # the layers after the last are DeepSeek's multi-token-prediction depths, which no transformers class
    # computes (its checkpoints carry them; DeepseekV3ForCausalLM ignores them too)
    unexpected = [k for k in unexpected if not _past_last_layer(k, cfg)]
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    # GPT-2's causal-mask buffers (attn.bias, masked_bias) are no weights: from_config builds them
    missing = [
        k for k in missing if k not in tied and not k.endswith(".attn.bias") and "masked_bias" not in k
    ]
    if missing or unexpected:
        raise ValueError(f"HF state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()  # lm_head then shares the loaded embedding, not from_config's random one
    return model.eval()


def _past_last_layer(key: str, cfg) -> bool:
    parts = key.split(".")
    layers = getattr(cfg, "num_hidden_layers", None)
    return (
        len(parts) > 2
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and layers is not None
        and int(parts[2]) >= layers
    )


def past_last_layer(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The tensors of `sd` in layers after the config's last: DeepSeek's multi-token-prediction depths, which
    the export writes beside the model's own (as DeepSeek's files carry them) and the import reads back."""
    return {k: v for k, v in sd.items() if _past_last_layer(k, cfg)}


def _read_past_last_layer(folder: Path, cfg) -> dict[str, torch.Tensor]:
    """past_last_layer's tensors of a folder's safetensors files (transformers' model drops them)."""
    if not getattr(cfg, "num_nextn_predict_layers", 0):
        return {}
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k).to(torch.float32) for k in st.keys() if _past_last_layer(k, cfg)})
    return out


def _fp32() -> dict:
    """The fp32 dtype keyword of from_config / from_pretrained
    (renamed torch_dtype -> dtype in transformers 5)."""
    import transformers

    return {"torch_dtype" if int(transformers.__version__.split(".")[0]) < 5 else "dtype": torch.float32}


def from_hf(source) -> tuple[dict, dict[str, torch.Tensor]]:
    """(megaframe ModelConfig fields, full fp32 megaframe state) from a transformers model of a registered
    family (models/registry.py), or from a local folder holding one (loaded offline)."""
    extra = {}
    if isinstance(source, (str, Path)):
        from megaframe.models.hf_rope import refuse_folder_rope_type

        folder = Path(source)
        refuse_folder_rope_type(folder)
        _open_weight_files(folder)
        from transformers import AutoModelForCausalLM

        source, info = AutoModelForCausalLM.from_pretrained(
            str(source), local_files_only=True, output_loading_info=True, **_fp32()
        )
        _refuse_missing(source, info)
        extra = _read_past_last_layer(folder, source.config)
    cfg = source.config
    # fp32 whatever the source's dtype: the import is the full-precision state a run starts from
    sd = {k: v.detach().to(torch.float32).cpu() for k, v in source.state_dict().items()} | extra
    bad = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:  # a NaN weight trains to nan (every step skipped) and a run "finishes" with nothing learnt
        raise ValueError(f"HF weights hold NaN/inf in {len(bad)} tensor(s): {', '.join(bad[:4])}")
    from megaframe.models.registry import by_model_type

    spec = by_model_type(cfg.model_type)
    fields, state = spec.from_hf(cfg, sd)
    return dict(fields, family=spec.name), state


def _open_weight_files(folder: Path) -> None:
    """Each safetensors file the folder's weights are in (its index's, else model.safetensors), opened:
    a truncated or corrupt one raises the SafetensorError transformers' load would, before transformers'
    modeling imports and the other files' tensors (seconds of CPU for a refusal). Tensors are not read."""
    import json

    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # a damaged index: transformers' load names it
    for name in names or ["model.safetensors"]:
        if (folder / name).is_file():
            with safe_open(str(folder / name), "pt"):
                pass


def _refuse_missing(model, info: dict) -> None:
    """transformers initialises a weight the folder lacks at random and only reports it: an import must
    not turn that into a checkpoint. Only a tied head may be absent (it is the embedding)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in info.get("missing_keys", []) if not (tied and k.endswith("lm_head.weight"))]
    if missing:
        raise ValueError(
            f"the HF weights lack {len(missing)} tensor(s) the model needs: {', '.join(sorted(missing)[:4])}"
            + (" ..." if len(missing) > 4 else "")
        )


def model_overrides(fields: dict) -> list[str]:
    """Hydra overrides (`model.num_layers=2`, `model.rope_scaling.factor=8.0`, ...) that make train.py build
    the model `fields` describe (a nested group, a dataclass, becomes one override per field)."""
    import dataclasses

    def fmt(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    out = []
    for k, v in fields.items():
        if dataclasses.is_dataclass(v):
            out += [f"model.{k}.{f.name}={fmt(getattr(v, f.name))}" for f in dataclasses.fields(v)]
        else:
            out.append(f"model.{k}={fmt(v)}")
    return out


def save_tokenizer(spm_model: str | Path, out: str | Path, model_max_length: int | None = None):
    """Write a sentencepiece BPE model (as megaframe.data.prepare trains it: byte fallback, identity
    normalization, dummy prefix, no bos) to `out` as a transformers fast tokenizer (tokenizer.json) that
    AutoTokenizer loads offline and that encodes exactly like sentencepiece (no special tokens added,
    literal "</s>" in text stays text). Returns the transformers tokenizer."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    proto = _spm_proto(sp)
    if proto.trainer_spec.model_type != 2:  # sentencepiece's ModelType: 2 = BPE
        raise ValueError(f"{spm_model}: only sentencepiece BPE models are converted")
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    plain = {p for p, i in vocab.items() if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    merges = []  # every split of a piece into two pieces, ranked by the merged piece's id (= BPE merge order)
    for piece in sorted(plain, key=vocab.get):
        pairs = [
            (piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in plain and piece[k:] in plain
        ]
        merges += sorted(pairs, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    unk = sp.id_to_piece(sp.unk_id())
    # byte_fallback as trained: a character outside the vocabulary becomes <0xNN> pieces, not unk
    tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = _spm_normalizer(proto.normalizer_spec)
    # the dummy prefix's space
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = {"unk_token": unk}
    if sp.eos_id() >= 0:
        special["eos_token"] = sp.id_to_piece(sp.eos_id())
    if sp.bos_id() >= 0:
        special["bos_token"] = sp.id_to_piece(sp.bos_id())
    # split_special_tokens: a literal "</s>" in text is encoded as text, as sentencepiece does
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        **special,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    )
    hf_tok.save_pretrained(str(out))
    return hf_tok


def _spm_proto(sp):
    from sentencepiece import sentencepiece_model_pb2 as pb

    return pb.ModelProto.FromString(sp.serialized_model_proto())


def _spm_normalizer(spec):
    """sentencepiece's normalizer: charsmap, whitespace squeezing, dummy prefix, spaces -> U+2581."""
    from tokenizers import Regex, normalizers

    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("\u2581"))
    return normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
