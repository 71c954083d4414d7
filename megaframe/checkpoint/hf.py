"""Hugging Face transformers interop: megaframe full tensors <-> LlamaForCausalLM / GPT2LMHeadModel.

megaframe names and layouts (full, unsharded tensors; D hidden, V vocab rows, S seq_length,
H query heads, K kv heads (num_query_groups), E head dim = D/H, F ffn_hidden_size):
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
Vocabulary: all V embedding rows are exported (the tokenizer may have fewer pieces).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megaframe.schema import ModelConfig

LLAMA_LAYER = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
               "attn.out_proj.weight": "self_attn.o_proj.weight", "attn.out_proj.bias": "self_attn.o_proj.bias",
               "mlp.down_proj.weight": "mlp.down_proj.weight", "mlp.down_proj.bias": "mlp.down_proj.bias"}
GPT2_LAYER = {"attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
              "mlp_norm.weight": "ln_2.weight", "mlp_norm.bias": "ln_2.bias",
              "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
              "attn.out_proj.weight": "attn.c_proj.weight", "attn.out_proj.bias": "attn.c_proj.bias",
              "mlp.up_proj.weight": "mlp.c_fc.weight", "mlp.up_proj.bias": "mlp.c_fc.bias",
              "mlp.down_proj.weight": "mlp.c_proj.weight", "mlp.down_proj.bias": "mlp.c_proj.bias"}
GPT2_TOP = {"embed.weight": "transformer.wte.weight", "pos_embed": "transformer.wpe.weight",
            "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias",
            "head.weight": "lm_head.weight"}
LLAMA_TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def family(m: ModelConfig) -> str:
    """'llama' or 'gpt2': the transformers architecture that computes exactly what `m` computes."""
    style = (m.norm, m.activation, m.position_embedding)
    if m.num_experts:
        return _mixtral_family(m, style)
    if style == ("rmsnorm", "swiglu", "rope"):
        return "llama"
    if style == ("layernorm", "gelu", "learned") and m.kv_heads == m.num_attention_heads:
        return "gpt2"
    raise ValueError(f"no transformers architecture matches norm={m.norm}, activation={m.activation}, "
                     f"position_embedding={m.position_embedding}, kv heads {m.kv_heads}/{m.num_attention_heads} "
                     "(supported: rmsnorm+swiglu+rope -> Llama; layernorm+gelu+learned without GQA -> GPT-2)")


def _mixtral_family(m: ModelConfig, style: tuple) -> str:
    """'mixtral' when the MoE model computes what MixtralForCausalLM computes, else ValueError naming why."""
    why = []
    if style != ("rmsnorm", "swiglu", "rope"):
        why.append(f"norm/activation/positions {'/'.join(style)} (Mixtral: rmsnorm/swiglu/rope)")
    if m.moe_router_score != "softmax":
        why.append(f"model.moe_router_score={m.moe_router_score} (Mixtral: softmax)")
    if m.moe_expert_bias:
        why.append("model.moe_expert_bias=true (Mixtral selects by the plain scores)")
    if m.moe_capacity_factor is not None:
        why.append(f"model.moe_capacity_factor={m.moe_capacity_factor} (Mixtral is dropless)")
    if m.bias:
        why.append("model.bias=true (Mixtral has no biases)")
    if why:
        raise ValueError("this MoE model has no transformers equivalent: " + "; ".join(why))
    return "mixtral"


def _mixtral_out(m: ModelConfig, name: str, split, t: torch.Tensor) -> dict[str, torch.Tensor]:
    from megaframe.checkpoint.hf_mixtral import MIXTRAL_MOE, experts_out

    if split is None:
        if name not in LLAMA_TOP:
            raise ValueError(f"unexpected megaframe tensor {name!r} for a mixtral export")
        return {LLAMA_TOP[name]: t}
    i, rest = split
    if rest in MIXTRAL_MOE:
        return experts_out(i, rest, t)
    return _llama_layer_out(m, i, rest, t)


def _rope_config(cls, kw: dict, theta: float, arch: str):
    """A RoPE family's transformers config: rope_theta where transformers >= 5 moved it (rope_parameters)."""
    if "rope_parameters" in cls().to_dict():  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    cfg = cls(**kw)
    cfg.architectures = [arch]
    return cfg


def _mixtral_config(m: ModelConfig, eos, bos):
    from transformers import MixtralConfig

    kw = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.expert_ffn,
              num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
              num_key_value_heads=m.kv_heads, head_dim=m.head_dim, hidden_act="silu",
              max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
              num_local_experts=m.num_experts, num_experts_per_tok=m.moe_top_k,
              # no jitter, no sliding window: the export must compute exactly what megaframe's router and attention compute
              router_aux_loss_coef=m.moe_aux_loss_coeff, router_jitter_noise=0.0, sliding_window=None,
              attention_dropout=m.dropout, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
              initializer_range=m.init_std)
    return _rope_config(MixtralConfig, kw, m.rope_theta, "MixtralForCausalLM")


def _split_layer_key(name: str) -> tuple[int, str] | None:
    if not name.startswith("layers."):
        return None
    _, i, rest = name.split(".", 2)
    return int(i), rest


def to_hf(m: ModelConfig, state: dict[str, torch.Tensor], eos_token_id: int | None = None,
          bos_token_id: int | None = None):
    """(transformers config, HF state_dict) for megaframe full tensors `state` (names as in the module doc).

    The state_dict omits lm_head.weight when the embeddings are tied (transformers ties it itself)."""
    fam = family(m)
    make = {"llama": _llama_config, "gpt2": _gpt2_config, "mixtral": _mixtral_config}[fam]
    cfg = make(m, eos_token_id, bos_token_id)
    sd = {}
    for name, t in state.items():
        t = t.detach().cpu()
        split = _split_layer_key(name)
        if fam == "mixtral":
            if split is not None and split[1] == "mlp.router.expert_bias":
                continue  # a selection-only buffer, unused (zero) when model.moe_expert_bias is off
            sd.update(_mixtral_out(m, name, split, t))
        elif split is None:
            top = LLAMA_TOP if fam == "llama" else GPT2_TOP
            if name not in top:
                raise ValueError(f"unexpected megaframe tensor {name!r} for a {fam} export")
            sd[top[name]] = t
        elif fam == "llama":
            sd.update(_llama_layer_out(m, *split, t))
        else:
            i, rest = split
            if rest not in GPT2_LAYER:
                raise ValueError(f"unexpected megaframe tensor {name!r} for a gpt2 export")
            # Conv1D stores [in, out]: a matrix is transposed both ways, vectors pass as they are
            sd[f"transformer.h.{i}.{GPT2_LAYER[rest]}"] = t.t().contiguous() if t.ndim == 2 else t
    if fam == "gpt2" and not m.bias:  # GPT-2's Conv1D layers always carry biases: export zeros
        _add_zero_gpt2_biases(m, sd)
    return cfg, sd


def _llama_layer_out(m: ModelConfig, i: int, rest: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{i}."
    e = m.head_dim
    if rest.startswith("attn.qkv."):
        q, k, v = t.split([m.num_attention_heads * e, m.kv_heads * e, m.kv_heads * e], dim=0)
        kind = rest.rsplit(".", 1)[1]
        return {f"{pre}self_attn.{p}_proj.{kind}": x.contiguous() for p, x in zip("qkv", (q, k, v))}
    if rest.startswith("mlp.up_proj."):
        gate, up = t.chunk(2, dim=0)
        kind = rest.rsplit(".", 1)[1]
        return {f"{pre}mlp.gate_proj.{kind}": gate.contiguous(), f"{pre}mlp.up_proj.{kind}": up.contiguous()}
    if rest not in LLAMA_LAYER:
        raise ValueError(f"unexpected megaframe tensor layers.{i}.{rest} for a llama export")
    return {pre + LLAMA_LAYER[rest]: t}


def _add_zero_gpt2_biases(m: ModelConfig, sd: dict) -> None:
    d, f = m.hidden_size, m.ffn_hidden_size
    for i in range(m.num_layers):
        for key, n in (("attn.c_attn", 3 * d), ("attn.c_proj", d), ("mlp.c_fc", f), ("mlp.c_proj", d)):
            sd.setdefault(f"transformer.h.{i}.{key}.bias", torch.zeros(n))


def _llama_config(m: ModelConfig, eos, bos):
    from transformers import LlamaConfig

    kw = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
              num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
              num_key_value_heads=m.kv_heads, head_dim=m.head_dim, hidden_act="silu",
              max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
              attention_bias=m.bias, mlp_bias=m.bias, attention_dropout=m.dropout, bos_token_id=bos,
              eos_token_id=eos, pad_token_id=None, initializer_range=m.init_std)
    return _rope_config(LlamaConfig, kw, m.rope_theta, "LlamaForCausalLM")


def _gpt2_config(m: ModelConfig, eos, bos):
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=m.vocab_size, n_positions=m.seq_length, n_embd=m.hidden_size, n_layer=m.num_layers,
                     n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size, activation_function="gelu_new",  # = tanh GELU
                     resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
                     layer_norm_epsilon=m.norm_eps, initializer_range=m.init_std, tie_word_embeddings=m.tie_embeddings,
                     bos_token_id=bos, eos_token_id=eos)
    cfg.architectures = ["GPT2LMHeadModel"]
    return cfg


def build_hf_model(cfg, sd: dict[str, torch.Tensor]):
    """A transformers causal LM for `cfg`, holding exactly `sd` (strict: every weight must be given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, **_fp32())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    # GPT-2's causal-mask buffers (attn.bias, masked_bias) are no weights: from_config builds them
    missing = [k for k in missing if k not in tied and not k.endswith(".attn.bias") and "masked_bias" not in k]
    if missing or unexpected:
        raise ValueError(f"HF state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()  # lm_head then shares the loaded embedding, not from_config's random one
    return model.eval()


def _fp32() -> dict:
    """The fp32 dtype keyword of from_config / from_pretrained (renamed torch_dtype -> dtype in transformers 5)."""
    import transformers

    return {"torch_dtype" if int(transformers.__version__.split(".")[0]) < 5 else "dtype": torch.float32}


def from_hf(source) -> tuple[dict, dict[str, torch.Tensor]]:
    """(megaframe ModelConfig fields, full fp32 megaframe state) from a transformers Llama or GPT-2 model,
    or from a local folder holding one (loaded offline)."""
    if isinstance(source, (str, Path)):
        from transformers import AutoModelForCausalLM

        source, info = AutoModelForCausalLM.from_pretrained(str(source), local_files_only=True,
                                                            output_loading_info=True, **_fp32())
        _refuse_missing(source, info)
    cfg = source.config
    # fp32 whatever the source's dtype: the import is the full-precision state a run starts from
    sd = {k: v.detach().to(torch.float32).cpu() for k, v in source.state_dict().items()}
    bad = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:  # a NaN weight trains to nan (every step skipped) and a run "finishes" with nothing learnt
        raise ValueError(f"HF weights hold NaN/inf in {len(bad)} tensor(s): {', '.join(bad[:4])}")
    if cfg.model_type == "llama":
        return _llama_fields(cfg), _llama_state(cfg, sd)
    if cfg.model_type == "gpt2":
        return _gpt2_fields(cfg), _gpt2_state(cfg, sd)
    if cfg.model_type == "mixtral":
        from megaframe.checkpoint.hf_mixtral import mixtral_fields, mixtral_state

        return mixtral_fields(cfg, _rope_theta(cfg)), mixtral_state(cfg, sd)
    raise ValueError(f"unsupported transformers model_type {cfg.model_type!r} (supported: llama, gpt2, mixtral)")


def _refuse_missing(model, info: dict) -> None:
    """transformers initialises a weight the folder lacks at random and only reports it: an import must
    not turn that into a checkpoint. Only a tied head may be absent (it is the embedding)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in info.get("missing_keys", []) if not (tied and k.endswith("lm_head.weight"))]
    if missing:
        raise ValueError(f"the HF weights lack {len(missing)} tensor(s) the model needs: {', '.join(sorted(missing)[:4])}"
                         + (" ..." if len(missing) > 4 else ""))


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default") if params else (getattr(cfg, "rope_scaling", None) or {}).get(
        "rope_type", "default")
    if kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} is not supported (megaframe uses plain RoPE)")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _llama_fields(cfg) -> dict:
    if cfg.hidden_act != "silu":
        raise ValueError(f"Llama hidden_act={cfg.hidden_act!r} is not supported (megaframe SwiGLU uses silu)")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"head_dim={head_dim} x heads != hidden_size={cfg.hidden_size}: not supported")
    if bool(getattr(cfg, "attention_bias", False)) != bool(getattr(cfg, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias != mlp_bias is not supported (megaframe has one `bias` flag)")
    return dict(name="hf_llama", num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
                ffn_hidden_size=cfg.intermediate_size, seq_length=cfg.max_position_embeddings,
                vocab_size=cfg.vocab_size, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                tie_embeddings=bool(cfg.tie_word_embeddings), bias=bool(getattr(cfg, "attention_bias", False)),
                rope_theta=_rope_theta(cfg), norm_eps=float(cfg.rms_norm_eps), dropout=0.0)


def _gpt2_fields(cfg) -> dict:
    if cfg.activation_function not in GELU_TANH:
        raise ValueError(f"GPT-2 activation_function={cfg.activation_function!r} is not supported (tanh GELU only)")
    if cfg.scale_attn_by_inverse_layer_idx or not cfg.scale_attn_weights:
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    return dict(name="hf_gpt2", num_layers=cfg.n_layer, hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head,
                # n_inner=None means GPT-2's default of 4·D
                num_query_groups=None, ffn_hidden_size=cfg.n_inner or 4 * cfg.n_embd, seq_length=cfg.n_positions,
                vocab_size=cfg.vocab_size, norm="layernorm", activation="gelu", position_embedding="learned",
                tie_embeddings=bool(cfg.tie_word_embeddings), bias=True, norm_eps=float(cfg.layer_norm_epsilon),
                dropout=0.0)


def _llama_state(cfg, sd: dict) -> dict[str, torch.Tensor]:
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    kinds = ("weight", "bias") if getattr(cfg, "attention_bias", False) else ("weight",)
    for i in range(cfg.num_hidden_layers):
        pre, mine = f"model.layers.{i}.", f"layers.{i}."
        for kind in kinds:
            out[f"{mine}attn.qkv.{kind}"] = torch.cat([sd[f"{pre}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            out[f"{mine}mlp.up_proj.{kind}"] = torch.cat([sd[f"{pre}mlp.{p}_proj.{kind}"] for p in ("gate", "up")])
        for rest, theirs in LLAMA_LAYER.items():
            if pre + theirs in sd:
                out[mine + rest] = sd[pre + theirs]
    return out


def _gpt2_state(cfg, sd: dict) -> dict[str, torch.Tensor]:
    out = {mine: sd[theirs] for mine, theirs in GPT2_TOP.items() if mine != "head.weight"}
    if not cfg.tie_word_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        for rest, theirs in GPT2_LAYER.items():
            t = sd[f"transformer.h.{i}.{theirs}"]
            out[f"layers.{i}.{rest}"] = t.t().contiguous() if t.ndim == 2 else t
    return out


def model_overrides(fields: dict) -> list[str]:
    """Hydra overrides (`model.num_layers=2`, ...) that make train.py build the model `fields` describe."""
    def fmt(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return [f"model.{k}={fmt(v)}" for k, v in fields.items()]


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
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in plain and piece[k:] in plain]
        merges += sorted(pairs, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    unk = sp.id_to_piece(sp.unk_id())
    # byte_fallback as trained: a character outside the vocabulary becomes <0xNN> pieces, not unk
    tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = _spm_normalizer(proto.normalizer_spec)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # the dummy prefix's space
    special = {"unk_token": unk}
    if sp.eos_id() >= 0:
        special["eos_token"] = sp.id_to_piece(sp.eos_id())
    if sp.bos_id() >= 0:
        special["bos_token"] = sp.id_to_piece(sp.bos_id())
    # split_special_tokens: a literal "</s>" in text is encoded as text, as sentencepiece does
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, split_special_tokens=True, clean_up_tokenization_spaces=False,
                                     **special, **({"model_max_length": model_max_length} if model_max_length else {}))
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
