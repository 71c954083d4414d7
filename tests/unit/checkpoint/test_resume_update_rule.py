"""A resume and the update rule: a checkpoint of another rule (optim.name) is refused by name unless
checkpoint.allow_config_change lists it, and then its optimizer state is not read (the new rule's starts
fresh, said in one line); a checkpoint from before optim.name and optim.state_dtype existed resumes as the
default's; another optim.state_dtype converts as it is read, said in one line."""

from __future__ import annotations

import pytest

from megaframe.checkpoint.load import load_targets
from megaframe.checkpoint.resume_checks import check_resume
from megaframe.config import ConfigError
from megaframe.config.schema import plain
from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model


def meta_of(cfg, **optim) -> dict:
    config = plain(cfg)
    config["optim"].update(optim)
    return {"step": 2, "consumed_samples": 2 * cfg.train.global_batch_size, "config": config}


def test_another_rules_checkpoint_is_refused_by_name(capsys):
    cfg = tiny_config([], 1)
    with pytest.raises(ConfigError) as info:
        check_resume(cfg, meta_of(cfg, name="lion"), "ckpt", verbose=True)
    msg = str(info.value)
    assert "optim.name='lion'" in msg and "update rule" in msg and "allow_config_change=[optim.name]" in msg
    assert "\n" not in msg
    allowed = tiny_config(["checkpoint.allow_config_change=[optim.name]"], 1)
    capsys.readouterr()
    check_resume(allowed, meta_of(allowed, name="lion"), "ckpt", verbose=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.name" in err[0] and "starts fresh" in err[0], err


def test_a_checkpoint_without_the_rule_keys_resumes_silently(capsys):
    cfg = tiny_config([], 1)
    meta = meta_of(cfg)
    del meta["config"]["optim"]["name"], meta["config"]["optim"]["state_dtype"]
    capsys.readouterr()
    check_resume(cfg, meta, "ckpt", verbose=True)
    assert capsys.readouterr().err == ""


def test_another_state_dtype_is_converted_in_one_line(capsys):
    cfg = tiny_config(["optim.state_dtype=bf16"], 1)
    capsys.readouterr()
    check_resume(cfg, meta_of(cfg, state_dtype="fp32"), "ckpt", verbose=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.state_dtype=bf16" in err[0] and "converted" in err[0], err


@pytest.mark.parametrize("saved_rule,reads_state", [(None, True), ("lion", False)])
def test_the_load_reads_state_of_its_own_rule_only(saved_rule, reads_state):
    cfg = tiny_config(["optim.zero=0"], 1)
    mesh = single_process_mesh()
    model = build_model(cfg, mesh)
    optimizer = build_optimizer(model, cfg.optim, mesh)
    name, p = next(iter(model.named_parameters()))
    keys = [f"model/{name}"] + [f"optim/{k}/{name}" for k in optimizer.rule.states]
    meta = meta_of(cfg, **({"name": saved_rule} if saved_rule else {}))
    meta["tensors"] = {k: {"dtype": "float32"} for k in keys}
    items, _, done = load_targets(model, optimizer, meta)
    assert [i.key for i in items if i.key.endswith(f"/{name}")] == (keys if reads_state else keys[:1])
    assert len(done) == (1 if reads_state else 0)  # no step count set: a fresh rule starts at step 0
