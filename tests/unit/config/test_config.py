"""The config contract: the frozen key set, every model
preset, and the one-line ConfigError of each bad setting."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megaframe.config import CONF_DIR, Config, ConfigError, ModelConfig, load_config, validate

# Adding, renaming or removing a config key is a deliberate edit of this list (and of the docs that cite it).
EXPECTED_KEYS = sorted(
    """
checkpoint.allow_config_change checkpoint.async checkpoint.dir checkpoint.interval checkpoint.interval_minutes
checkpoint.keep_last checkpoint.on_save_error checkpoint.resume checkpoint.save_timeout_s
data.blend data.kind data.name data.num_workers data.path data.source data.text_key data.tokenizer
data.tokenizer_sample_bytes data.valid_fraction data.vocab_size data.extensions data.split
logging.tensorboard.dir logging.tensorboard.enabled
logging.wandb.entity logging.wandb.mode logging.wandb.project
model.activation model.bias model.dropout model.ffn_hidden_size model.hidden_size model.init_std
model.moe_aux_loss_coeff model.moe_bias_update_rate model.moe_capacity_factor model.moe_expert_bias
model.moe_ffn_hidden_size model.moe_router_score model.moe_top_k model.moe_z_loss_coeff model.name model.norm
model.norm_eps model.num_attention_heads model.num_experts
model.num_layers model.num_query_groups model.position_embedding model.rope_theta model.seq_length
model.tie_embeddings model.vocab_size model.kv_channels model.qk_norm model.family
model.max_position_embeddings
model.moe_shared_experts model.moe_n_group model.moe_topk_group model.moe_norm_topk_prob
model.moe_force_balance
model.moe_routed_scaling_factor model.moe_dense_layers model.moe_seq_aux_loss_coeff model.q_lora_rank
model.kv_lora_rank model.qk_nope_head_dim model.qk_rope_head_dim model.v_head_dim model.mtp_num_layers
model.mtp_loss_weight
model.rope_scaling.rope_type model.rope_scaling.factor model.rope_scaling.low_freq_factor
model.rope_scaling.high_freq_factor model.rope_scaling.original_max_position_embeddings
model.rope_scaling.beta_fast model.rope_scaling.beta_slow model.rope_scaling.attention_factor
model.rope_scaling.mscale model.rope_scaling.mscale_all_dim model.rope_scaling.truncate
optim.beta1 optim.beta2 optim.bucket_size_mb optim.clip_grad optim.eps optim.lr optim.min_lr
optim.warmup_steps
optim.weight_decay optim.zero optim.shard_group_size optim.overlap_param_gather optim.reshard_after_forward
optim.lr_schedule optim.lr_decay_steps optim.wsd_decay_fraction optim.grad_reduce_dtype optim.name
optim.state_dtype optim.muon.adamw_lr optim.muon.momentum optim.muon.nesterov optim.muon.ns_steps
optim.muon.adjust_lr_fn optim.step_kernel
parallel.cp parallel.cp_comm parallel.ep parallel.etp parallel.pp parallel.pp_layout parallel.pp_schedule
parallel.sp parallel.tp parallel.vpp parallel.ep_dispatch parallel.ranks_per_node
parallel.tp_comm_overlap parallel.tp_comm_chunks train.fp8_recipe data.stages data.document_mask data.task
data.num_tasks
run.dir run.name
train.device train.global_batch_size train.log_interval train.max_bad_steps train.max_steps
train.micro_batch_size train.precision
train.seed train.eval_interval train.eval_iters train.hang_timeout_s train.compile train.compile_timeout_s
train.recompute
train.dist_timeout_s train.signal_check_interval train.threads train.fp8_head train.fused_head_loss
train.sample_interval train.sample_prompts train.sample_tokens
train.downstream_interval train.downstream_tasks train.downstream_include_path train.downstream_limit
train.downstream_batch_size train.downstream_harness_timeout_s
train.profile_steps train.memory_snapshot
""".split()
)

PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def flatten(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def param_count(m: ModelConfig) -> int:
    """Parameters computed from the dims alone: the model family's counter (megaframe/models/counts.py)."""
    from megaframe.models.registry import spec_of

    return spec_of(m).total_params(m)


def one_line_error(overrides, world_size=1, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, world_size=world_size, **kw)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def test_config_keys_are_frozen():
    assert sorted(flatten(dataclasses.asdict(Config()))) == EXPECTED_KEYS


def test_composed_config_has_exactly_the_schema_keys():
    cfg = load_config(["data=synthetic"], world_size=1)
    assert isinstance(cfg, Config)
    assert sorted(flatten(dataclasses.asdict(cfg))) == EXPECTED_KEYS


def test_presets_exist():
    assert {
        "gpt_tiny",
        "gpt2_tiny",
        "gpt2_small",
        "llama3_8b",
        "llama_1b",
        "moe_tiny",
        "mixtral_8x7b",
    } <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_validates_and_counts_match_the_model(name):
    from megaframe.model.gpt import GPT
    from megaframe.models.registry import spec_of
    from megaframe.parallel.mesh import single_process_mesh

    cfg = load_config([f"model={name}", "data=synthetic"], world_size=1)
    assert cfg.model.name == name
    assert cfg.data.kind == "synthetic"
    # the count from dims equals the real model's parameter count (built on meta: no memory), with the
    # blocks of the preset's family
    block = spec_of(cfg.model).block
    model = GPT(cfg.model, single_process_mesh(), device=torch.device("meta"), block=block)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg.model)


@pytest.mark.parametrize(
    "name,lo,hi",
    [
        ("llama3_8b", 7.5e9, 8.5e9),  # 8.03B
        ("llama_1b", 1.1e9, 1.6e9),  # 1.2B untied body + 0.26B head
        ("gpt2_small", 123.5e6, 125.5e6),  # 124.4M with tied embeddings (124.48M with vocab padded to 50304)
        ("mixtral_8x7b", 46.6e9, 46.8e9),  # 46.7B
        ("deepseek_v2_lite", 15.6e9, 15.8e9),  # 15.7B
        ("deepseek_v3_671b", 682.5e9, 682.8e9),  # 671.0B and its MTP depth's 11.6B (block and eh_proj)
    ],
)
def test_preset_sizes_are_plausible(name, lo, hi):
    cfg = load_config([f"model={name}", "data=synthetic"], world_size=1)
    n = param_count(cfg.model)
    assert lo <= n <= hi, n


def test_gpt2_small_exact_count():
    # GPT-2 small is published as 124,439,808 parameters with vocab 50257; +47 padded rows x 768.
    cfg = load_config(["model=gpt2_small", "data=synthetic"], world_size=1)
    assert cfg.model.tie_embeddings and cfg.model.vocab_size == 50304
    assert param_count(cfg.model) == 124_439_808 + 47 * 768


def test_llama3_8b_exact_count():
    cfg = load_config(["model=llama3_8b", "data=synthetic"], world_size=1)
    assert param_count(cfg.model) == 8_030_261_248  # Meta-Llama-3-8B


def test_overrides_reach_the_dataclasses():
    cfg = load_config(
        [
            "model=gpt2_tiny",
            "data=synthetic",
            "parallel.tp=2",
            "parallel.sp=true",
            "train.max_steps=7",
            "optim.lr=0.5",
        ],
        world_size=4,
    )
    assert (cfg.parallel.tp, cfg.parallel.sp, cfg.train.max_steps, cfg.optim.lr) == (2, True, 7, 0.5)
    assert cfg.model.norm == "layernorm" and cfg.model.tie_embeddings


def test_typo_key_is_a_one_line_error():
    assert "hiden_size" in one_line_error(["model.hiden_size=3", "data=synthetic"])


def test_plus_keys_outside_the_schema_are_refused_with_the_closest_key():
    # before the strict check `+train.max_step=10` composed, exited 0 and the setting vanished
    msg = one_line_error(["+train.max_step=10", "data=synthetic"])
    assert "did you mean train.max_steps?" in msg and "use +" not in msg
    msg = one_line_error(["train.max_step=10", "data=synthetic"])
    assert "did you mean train.max_steps?" in msg and "+train" not in msg.split(":", 1)[1]
    assert "not a config key" in one_line_error(["++optim.lrr=1", "data=synthetic"])
    assert "megaframe.plan" in one_line_error(["+world_size=8", "data=synthetic"])  # a tool's own key
    assert load_config(
        ["data=synthetic", "data.blend=[{path: /x, weight: 1}]"], world_size=1, check_data=False
    )


def test_wrong_type_is_a_one_line_error():
    assert "train.max_steps" in one_line_error(["train.max_steps=abc", "data=synthetic"])


def test_unknown_preset_is_a_one_line_error():
    assert "no_such_model" in one_line_error(["model=no_such_model", "data=synthetic"])


@pytest.mark.parametrize(
    "overrides,world,names",
    [
        (["parallel.tp=3"], 2, ["parallel.tp"]),
        (
            ["model.num_attention_heads=6", "model.hidden_size=192", "parallel.tp=4"],
            4,
            ["parallel.tp", "model.num_attention_heads"],
        ),
        (["parallel.tp=4"], 4, ["parallel.tp", "model.num_query_groups"]),  # gpt_tiny: 4 heads, 2 kv groups
        (["model.num_query_groups=3"], 1, ["model.num_query_groups"]),
        (["model.hidden_size=130"], 1, ["model.hidden_size"]),
        (["model.ffn_hidden_size=351", "parallel.tp=2"], 2, ["model.ffn_hidden_size"]),
        (["model.vocab_size=4095", "parallel.tp=2"], 2, ["model.vocab_size"]),
        (["train.global_batch_size=8", "train.micro_batch_size=4"], 4, ["train.global_batch_size"]),
        (
            ["train.global_batch_size=12", "train.micro_batch_size=4", "parallel.tp=2"],
            4,
            ["train.global_batch_size"],
        ),
        (
            ["parallel.sp=true", "parallel.tp=2", "model.seq_length=127"],
            2,
            ["parallel.sp", "model.seq_length"],
        ),
        (["parallel.pp=2", "model.num_layers=3"], 2, ["model.num_layers", "parallel.pp_layout"]),
        (["parallel.vpp=2"], 1, ["parallel.vpp"]),
        (["parallel.pp=2", "parallel.pp_layout=[1,2]"], 2, ["parallel.pp_layout"]),
        (["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=12"], 2, ["parallel.pp"]),
        (["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.vpp=2"], 2, ["parallel.vpp"]),
        (["parallel.pp=2", "parallel.pp_schedule=zigzag"], 2, ["parallel.pp_schedule"]),
        (["optim.zero=4"], 2, ["optim.zero"]),
        (["optim.name=lion"], 1, ["optim.name='lion'", "adamw"]),
        (["optim.shard_group_size=3"], 4, ["optim.shard_group_size", "dp=4"]),
        (["optim.shard_group_size=2", "optim.zero=0"], 4, ["optim.shard_group_size", "optim.zero"]),
        (["train.hang_timeout_s=-1"], 1, ["train.hang_timeout_s"]),
        (["train.dist_timeout_s=0"], 1, ["train.dist_timeout_s"]),
        (["checkpoint.save_timeout_s=-5"], 1, ["checkpoint.save_timeout_s"]),
        (["train.signal_check_interval=0"], 1, ["train.signal_check_interval"]),
        (["optim.bucket_size_mb=0"], 2, ["optim.bucket_size_mb"]),
        (["train.precision=fp16"], 1, ["train.precision"]),
        (["train.precision=bf16", "optim.zero=0"], 2, ["train.precision", "optim.zero"]),
        (["model.norm=batchnorm"], 1, ["model.norm"]),
        (["model.dropout=1.0"], 1, ["model.dropout"]),
        (["logging.wandb.mode=loud"], 1, ["logging.wandb.mode"]),
        (["checkpoint.resume=/nonexistent/step_00000010"], 1, ["checkpoint.resume"]),
        (["parallel.cp=3"], 2, ["parallel.cp=3", "world size"]),
        (["parallel.cp=0"], 1, ["parallel.cp"]),
        (["parallel.cp=2", "model.seq_length=30"], 2, ["parallel.cp", "model.seq_length"]),
        (["parallel.cp=2", "parallel.cp_comm=zigzag"], 2, ["parallel.cp_comm"]),
        (
            ["parallel.cp=2", "train.global_batch_size=12", "train.micro_batch_size=4"],
            4,
            ["train.global_batch_size"],
        ),
        (["parallel.cp=2", "optim.shard_group_size=3"], 4, ["optim.shard_group_size", "cp·dp=4"]),
        (
            ["parallel.cp=2", "optim.shard_group_size=2", "optim.zero=0"],
            4,
            ["optim.shard_group_size", "optim.zero"],
        ),
    ],
)
def test_layout_errors_name_the_field(overrides, world, names):
    msg = one_line_error(["model=gpt_tiny", "data=synthetic", *overrides], world_size=world)
    for n in names:
        assert n in msg, msg


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["parallel.tp=2"], 2),
        (["parallel.tp=2", "parallel.sp=true"], 8),
        (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"], 8),
        (["parallel.cp=2", "optim.zero=2"], 4),
        (["parallel.cp=2", "optim.zero=3"], 4),
        (["parallel.cp=2", "optim.zero=2", "optim.shard_group_size=2"], 4),  # HSDP over cp·dp = 4
        (["parallel.cp=4", "optim.zero=1", "optim.shard_group_size=2"], 4),  # shard groups inside a cp group
        (["parallel.cp=2", "parallel.cp_comm=ring", "model.dropout=0.1"], 2),  # dropout in the ring
        (["train.global_batch_size=16", "train.micro_batch_size=2"], 8),
        (["checkpoint.resume=none"], 1),
        (["parallel.pp=2", "parallel.vpp=2"], 2),
        (["parallel.pp=2", "parallel.pp_layout=[3,1]"], 4),
        (["model=moe_tiny", "parallel.ep=4"], 4),
        (["model=moe_tiny", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true"], 4),
        (["model=moe_tiny", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true"], 2),  # ep over the tp pair
        (["model=moe_tiny", "parallel.ep=4", "parallel.tp=2", "parallel.sp=true"], 4),  # ep over tp x dp
        (["model=moe_tiny", "parallel.etp=2"], 2),
        (["model=moe_tiny", "parallel.ep=2", "optim.zero=1", "optim.shard_group_size=2"], 4),  # HSDP with ep
        (["model=moe_tiny", "parallel.ep=8", "parallel.pp=2", "train.global_batch_size=64"], 16),
        (["model=moe_tiny", "parallel.cp=2"], 2),  # MoE under cp: ep borrows from cp·dp
        (["model=moe_tiny", "parallel.cp=2", "parallel.ep=2"], 2),
        (["model=moe_tiny", "parallel.cp=2", "parallel.ep=4", "model.moe_capacity_factor=1.0"], 4),
    ],
)
def test_good_layouts_pass(overrides, world):
    load_config(["model=gpt_tiny", "data=synthetic", *overrides], world_size=world)


def test_resume_accepts_a_committed_checkpoint_folder(tmp_path):
    (tmp_path / "metadata.json").write_text(
        json.dumps({"format": "megaframe-ckpt-v1", "step": 0, "files": {}, "tensors": {}})
    )
    cfg = load_config(["data=synthetic", f"checkpoint.resume={tmp_path}"], world_size=1)
    assert cfg.checkpoint.resume == str(tmp_path)
    (tmp_path / "shard_00000.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "metadata.json").write_text(
        json.dumps(
            {
                "format": "megaframe-ckpt-v1",
                "step": 0,
                "tensors": {},
                "files": {"shard_00000.safetensors": {"bytes": 11, "crc32": 0}},
            }
        )
    )
    assert "corrupt" in one_line_error(["data=synthetic", f"checkpoint.resume={tmp_path}"])


def fake_prepared(folder: Path, vocab: int, tokenizer: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16", "shards": []}))
    if tokenizer:
        (folder / "tokenizer.model").write_bytes(b"not a real model")
    return folder


def test_missing_prepared_data_names_data_path(tmp_path):
    msg = one_line_error(["data=demo", f"data.path={tmp_path / 'nope'}"])
    assert "data.path" in msg and "nope" in msg


def test_empty_data_path_names_data_path():
    assert "data.path" in one_line_error(["data=demo", "data.path="])


def test_check_data_false_skips_the_data_check(tmp_path):
    load_config(["data=demo", f"data.path={tmp_path / 'nope'}"], world_size=1, check_data=False)


def test_vocab_smaller_than_the_tokenizer_names_model_vocab_size(tmp_path):
    path = fake_prepared(tmp_path / "prep", vocab=8192)
    msg = one_line_error(["data=demo", f"data.path={path}", "model.vocab_size=4096"])
    assert "model.vocab_size" in msg


def test_prepared_data_with_fitting_vocab_passes(tmp_path):
    path = fake_prepared(tmp_path / "prep", vocab=4000)
    cfg = load_config(["data=demo", f"data.path={path}", "model.vocab_size=4096"], world_size=1)
    assert cfg.data.path == str(path)


def test_missing_tokenizer_and_corrupt_meta_name_data_path(tmp_path):
    path = fake_prepared(tmp_path / "a", vocab=100, tokenizer=False)
    assert "tokenizer.model" in one_line_error(["data=demo", f"data.path={path}"])
    bad = tmp_path / "b"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    assert "data.path" in one_line_error(["data=demo", f"data.path={bad}"])


def test_validate_directly_uses_world_size():
    cfg = Config()
    cfg.data.kind = "synthetic"
    cfg.parallel.tp = 2
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match="parallel.tp"):
        validate(cfg, world_size=3)


def test_vocab_size_defaults_to_the_prepared_data_padded(tmp_path):
    # before: every preset said 4096, whatever the data's tokenizer (prepare's vocabulary given twice)
    path = fake_prepared(tmp_path / "d", vocab=300)
    assert load_config(["data=demo", f"data.path={path}"], world_size=1).model.vocab_size == 384
    assert (
        load_config(["data=demo", f"data.path={path}", "parallel.tp=2"], world_size=2).model.vocab_size == 384
    )
    assert (
        load_config(["data=demo", f"data.path={path}", "model.vocab_size=512"], world_size=1).model.vocab_size
        == 512
    )
    assert load_config(["data=synthetic", "data.vocab_size=1000"], world_size=1).model.vocab_size == 1024


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["parallel.pp_schedule=zbv"], "parallel.vpp=2"),
        (["parallel.pp_schedule=zb_h1", "parallel.vpp=2", "model.num_layers=4"], "parallel.vpp=1"),
        (
            ["parallel.pp_schedule=zbv", "parallel.vpp=2", "model.num_layers=4", "train.compile=true"],
            "train.compile",
        ),
        (["parallel.pp_schedule=zb_h1", "train.precision=fp8"], "train.precision=fp8"),
    ],
)
def test_zero_bubble_kinds_refuse_what_they_cannot_run(extra, needle):
    msg = one_line_error(["data=synthetic", "parallel.pp=2", *extra], world_size=2, check_data=False)
    assert needle in msg and "pp_schedule" in msg, msg
