"""A checkpoint folder whose newest checkpoint belongs to another run is continued only when
asked (runops/access/owner.py), bool fields take true/false only (K5), and data.path typed with a blend is
refused (K8). One process, real files, fake checkpoints (lineage reads metadata only)."""

import json
from types import SimpleNamespace

import pytest

from megaframe.checkpoint import lineage, sharded
from megaframe.config import ConfigError, load_config
from megaframe.runops.access import owner


def ckpt(root, step, who, parent=None, run_dir="/elsewhere"):
    """A committed step folder written by run `who` (None: a checkpoint older than owners, or an import)."""
    d = sharded.step_dir(root, step)
    d.mkdir(parents=True)
    pid = lineage._meta(parent)["lineage"]["id"] if parent else None
    lin = lineage.lineage_meta(f"{who}@launch", step, parent, pid, root, who or "", run_dir)
    (d / "metadata.json").write_text(
        json.dumps(
            {
                "format": sharded.FORMAT,
                "step": step,
                "files": {},
                "coverage": "exact",
                "tensors": {},
                "lineage": lin,
            }
        )
    )
    (root / "latest").write_text(d.name + "\n")
    return d


def cfg(run_dir, ckpt_dir, resume="auto"):
    run_dir.mkdir(parents=True, exist_ok=True)  # folders.claim made it
    return SimpleNamespace(dir=str(run_dir), name="b"), SimpleNamespace(dir=str(ckpt_dir), resume=str(resume))


@pytest.fixture
def shared(tmp_path):
    """Run A's checkpoints 2 and 4 in a checkpoint dir outside any run folder."""
    root = tmp_path / "shared"
    ckpt(root, 4, "A", ckpt(root, 2, "A"), run_dir=str(tmp_path / "a"))
    return root


@pytest.mark.parametrize("resume", ["auto", "none", "elsewhere"])
def test_another_runs_checkpoint_dir_is_refused_unless_asked(tmp_path, shared, resume):
    """A second run with its own run.dir silently resumed (auto) or wrote beside (none) the first's."""
    if resume == "elsewhere":
        resume = ckpt(tmp_path / "other", 1, None)
    with pytest.raises(ConfigError) as e:
        owner.settle(*cfg(tmp_path / "b", shared, resume))
    line = str(e.value)
    assert line.startswith(
        f"checkpoint.dir={shared}: its newest checkpoint step_00000004 belongs to another run "
        f"(A, run.dir {tmp_path / 'a'})"
    )
    assert f"pass checkpoint.resume={shared / 'step_00000004'} (or checkpoint.resume={shared})" in line
    assert not (tmp_path / "b" / owner.ID_NAME).exists()  # a refused run records no identity


def test_asked_on_purpose_it_continues_and_then_the_folder_is_this_runs(tmp_path, shared):
    mine = owner.settle(*cfg(tmp_path / "b", shared, shared / "step_00000002"))  # a step of that folder
    assert mine != "A" and (tmp_path / "b" / owner.ID_NAME).read_text().strip() == mine
    assert owner.settle(*cfg(tmp_path / "b", shared, shared / "step_00000004")) == mine  # a restart: same id
    ckpt(shared, 5, mine, shared / "step_00000004", run_dir=str(tmp_path / "b"))
    assert owner.settle(*cfg(tmp_path / "b", shared)) == mine  # its own `latest` now: auto continues
    with pytest.raises(ConfigError, match=r"step_00000005 belongs to another run \(" + mine):
        owner.settle(*cfg(tmp_path / "a", shared))  # and A is told, naming B
    # B continued A's history on purpose: B's keep_last never deletes A's checkpoints
    assert lineage.prune(shared, keep_last=1, owner=mine) == []
    assert [p.name for p in lineage.prune(shared, keep_last=1, owner="A")] == [
        "step_00000004",
        "step_00000002",
    ]


def test_a_checkpoint_dir_given_as_resume_means_its_latest(tmp_path, shared):
    c = load_config(
        ["data=synthetic", f"checkpoint.resume={shared}", f"run.dir={tmp_path / 'b'}"], world_size=1
    )
    assert c.checkpoint.resume == str(shared / "step_00000004")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError, match=f"^checkpoint.resume={tmp_path / 'empty'}: .*no committed checkpoint"
    ):
        load_config(["data=synthetic", f"checkpoint.resume={tmp_path / 'empty'}"], world_size=1)
    with pytest.raises(ConfigError, match="^checkpoint.resume='' must be auto, none or a checkpoint path"):
        load_config(["data=synthetic", "checkpoint.resume=''"], world_size=1)  # not the current folder


def test_the_same_run_and_its_own_folder_continue(tmp_path):
    """Restarts (Slurm requeue, torchrun, the same command) read the id back; a run folder whose id file is
    gone, or into whose checkpoints/ a step was copied, continues its own checkpoints; unowned ones are
    anyone's."""
    run = tmp_path / "run"
    first = owner.settle(*cfg(run, run / "checkpoints"))
    ckpt(run / "checkpoints", 3, first, run_dir=str(run))
    assert owner.settle(*cfg(run, run / "checkpoints", "none")) == first
    (run / owner.ID_NAME).unlink()
    assert owner.settle(*cfg(run, run / "checkpoints")) == first  # adopted from the folder's own checkpoints
    (run / owner.ID_NAME).write_bytes(b"\xff\x00junk")
    assert owner.settle(*cfg(run, run / "checkpoints")) == first  # a damaged id file is no identity either
    moved = tmp_path / "moved"
    run.rename(moved)
    assert owner.settle(*cfg(moved, moved / "checkpoints")) == first
    old = tmp_path / "old"
    ckpt(old, 7, None)  # before owners were recorded, or an import
    assert owner.settle(*cfg(tmp_path / "c", old)) not in (None, first)


def test_a_run_folder_without_its_id_adopts_no_owner_when_its_checkpoints_have_two(tmp_path):
    """Run B continued A's folder on purpose (its step 7 on A's step 4); A's id file then went. A restart of
    A must be refused as it was with the id, not adopt the newest head's owner and train on B's branch."""
    run, ck = tmp_path / "oa", tmp_path / "oa" / "checkpoints"
    a = owner.settle(*cfg(run, ck))
    ckpt(ck, 4, a, ckpt(ck, 2, a, run_dir=str(run)), run_dir=str(run))
    ckpt(ck, 7, "B", ck / "step_00000004", run_dir=str(tmp_path / "ob2"))
    refused = r"step_00000007 belongs to another run \(B, run.dir " + str(tmp_path / "ob2")
    with pytest.raises(ConfigError, match=refused):
        owner.settle(*cfg(run, ck))
    (run / owner.ID_NAME).unlink()
    with pytest.raises(ConfigError, match=refused):
        owner.settle(*cfg(run, ck))
    assert not (run / owner.ID_NAME).exists()  # no identity recorded, least of all B's


def test_a_bool_field_takes_only_true_or_false():
    """K5: optim.overlap_param_gather=2 was read as true
    (OmegaConf's lenient bools), and so for every bool field."""
    from megaframe.config.keys import bool_keys

    assert {"optim.overlap_param_gather", "checkpoint.async", "parallel.sp", "train.compile"} <= bool_keys()
    for key, value in [
        ("optim.overlap_param_gather", "2"),
        ("checkpoint.async", "yes"),
        ("parallel.sp", "'true'"),
        ("train.compile", "0"),
    ]:
        with pytest.raises(ConfigError, match=f"^{key}={value} must be true or false"):
            load_config(["data=synthetic", f"{key}={value}"], world_size=1, check_data=False)
    assert (
        load_config(
            ["data=synthetic", "optim.overlap_param_gather=false"], world_size=1, check_data=False
        ).optim.overlap_param_gather
        is False
    )


def test_data_path_typed_with_a_blend_is_refused_naming_both(tmp_path):
    """K8: the blend silently won over a typed data.path
    (the preset's data.path is not typed: the blend replaces it)."""
    blend = f"data.blend=[{{path: {tmp_path}, weight: 1}}]"
    for mix in (blend, f"data.stages=[{{blend: [{{path: {tmp_path}}}]}}]"):
        with pytest.raises(ConfigError, match=f"^data.path=/a and {mix.split('=')[0]}=.* are both set"):
            load_config([mix, "data.path=/a"], world_size=1, check_data=False)
    assert load_config([blend], world_size=1, check_data=False).data.blend[0].path == str(tmp_path)
