"""The user-facing commands end to end: one process, torchrun, bad input, resume, load_model."""

import json
import time

import pytest
import torch

from tests.e2e.helpers import TINY, metrics, train

pytestmark = pytest.mark.e2e


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_torchrun_tp4_sp_matches_one_process(tmp_path):
    # 3 steps: the second and third start from weights the tp4 optimizer step updated
    over = ["data=synthetic", *TINY, "train.max_steps=3", "train.log_interval=1"]
    one = train(over + [f"run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    four = train(over + ["parallel.tp=4", "parallel.sp=true", f"run.dir={tmp_path / 'tp4'}"], nproc=4)
    assert four.returncode == 0, four.stderr[-3000:]
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "tp4")
    assert [r["step"] for r in got] == list(range(1, 4))
    for a, b in zip(got, ref):
        assert _rel(a["loss"], b["loss"]) <= 1e-4, (a["loss"], b["loss"])
    # each rank holds a quarter of the sharded weights; tp traffic is counted
    assert got[0]["mem/params_bytes"] < 0.4 * ref[0]["mem/params_bytes"]
    assert got[0]["comm_bytes/tp"] > 0 and ref[0]["comm_bytes/tp"] == 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["parallel.tp=3"], "parallel.tp"),
        (["model.hiden_size=3"], "hiden_size"),
        (["data.path=/nonexistent/prepared"], "data.path"),
        (["train.global_batch_size=7"], "train.global_batch_size"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path):
    t0 = time.time()
    res = train(args + [f"run.dir={tmp_path}/r"], timeout=60)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("megaframe: error:"), res.stderr
    assert time.time() - t0 < 30
    assert not (tmp_path / "r").exists()


def test_torchrun_refuses_tp_that_does_not_divide_world(tmp_path):
    res = train(["data=synthetic", "parallel.tp=3", f"run.dir={tmp_path}/r"], nproc=2, timeout=120)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "megaframe: error: parallel.tp=3" in out and "exitcode" in out and ": 2" in out, out[-2000:]
    assert out.index("megaframe: error:") < out.index("exitcode")
    # (the torchrun failure summary's check lives here, the same torchrun): under torchrun the one-line error
    # came first, then ~35 lines of ChildFailedError ending in a link; the summary now ends with it
    tail = [ln for ln in out.splitlines() if ln.strip()][-3:]
    assert any("traceback : megaframe: error: parallel.tp=3" in ln for ln in tail), tail


@pytest.mark.parametrize(
    "nproc,layout", [(1, []), (2, ["parallel.tp=2", "parallel.sp=true"])], ids=["one", "tp2"]
)
def test_resume_continues_with_uninterrupted_losses(tmp_path, nproc, layout):
    """The README's resume, same command line plus checkpoint.resume=STEP_FOLDER into a new run.dir, with a
    preset that leaves vocab_size to the data (it was refused: 'model.vocab_size=None contradicts ...')."""
    over = ["model=gpt_tiny", "data=synthetic", *TINY, "train.max_steps=6", "train.log_interval=1", *layout]
    # tp2's ranks started as srun does (no torchrun agent): the resume is the subject, not the launcher
    full = train(over + ["checkpoint.interval=3", f"run.dir={tmp_path / 'a'}"], nproc=nproc, launcher="env")
    assert full.returncode == 0, full.stderr[-2000:]
    ck = tmp_path / "a" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_00000006"
    meta = json.loads((ck / "step_00000003" / "metadata.json").read_text())
    assert meta["step"] == 3 and meta["consumed_samples"] == 24
    assert meta["tensors"]["model/embed.weight"]["global_shape"] == [4096, 64]
    # a second run pointed at the step-3 checkpoint resumes there and continues identically
    resumed = train(
        over + [f"run.dir={tmp_path / 'b'}", f"checkpoint.resume={ck / 'step_00000003'}"],
        nproc=nproc,
        launcher="env",
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [4, 5, 6]
    for x, y in zip(a[3:], b):
        assert _rel(y["loss"], x["loss"]) <= 1e-6, (x, y)
    # the checkpoint (tp2: one shard per rank) loads as a one-process model (was its own tp2 torchrun,
    # test_tp2_checkpoint_loads_as_one_process_model)
    import megaframe

    model = megaframe.load_model(str(ck))
    ids = torch.randint(0, 4096, (2, 32))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 32, 4096) and torch.isfinite(logits).all()
    shards = sorted(p.name for p in (ck / "step_00000006").glob("*.safetensors"))
    assert shards == [f"shard_{r:05d}.safetensors" for r in range(nproc)], shards


def test_torchrun_pp4_vpp2_matches_one_process_and_checkpoint_loads(tmp_path):
    """Also the zero-bubble CLI path: parallel.pp_schedule=zbv through train.py, resumed from the pp4
    interleaved run's step-2 checkpoint (layout-free names; zbv's V at pp2 puts layers 0-1 and 6-7 on
    rank 0), continues with the one-process losses; its logged loss (computed on rank 0 under the V,
    logged by the last rank) is real."""
    over = [
        "data=synthetic",
        *TINY,
        "model.num_layers=8",
        # 4 steps, the checkpoint at 2: zbv continues for two steps, the second from its own update
        "train.max_steps=4",
        "train.log_interval=1",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
    ]
    one = train(over + [f"run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    pp = train(
        over + ["parallel.pp=4", "parallel.vpp=2", "checkpoint.interval=2", f"run.dir={tmp_path / 'pp'}"],
        nproc=4,
    )
    assert pp.returncode == 0, pp.stderr[-3000:]
    zbv = train(
        over
        + [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.pp_schedule=zbv",
            f"run.dir={tmp_path / 'zbv'}",
            f"checkpoint.resume={tmp_path / 'pp' / 'checkpoints' / 'step_00000002'}",
        ],
        nproc=2,
        launcher="env",  # its ranks started as srun does: the schedule is the subject (torchrun: pp4 above)
    )
    assert zbv.returncode == 0, zbv.stderr[-3000:]
    ref, got, after = metrics(tmp_path / "one"), metrics(tmp_path / "pp"), metrics(tmp_path / "zbv")
    assert [r["step"] for r in after] == [3, 4]
    for a, b in zip(got + after, ref + ref[2:]):
        assert _rel(a["loss"], b["loss"]) <= 1e-4, (a["loss"], b["loss"])
    assert got[0]["comm_bytes/pp"] > 0
    import megaframe

    ids = torch.randint(0, 4096, (2, 32))
    with torch.no_grad():
        a = megaframe.load_model(str(tmp_path / "pp" / "checkpoints"))(ids)
        b = megaframe.load_model(str(tmp_path / "one" / "checkpoints"))(ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
