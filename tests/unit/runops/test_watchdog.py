"""Watchdog, fault-injection parsing and the collective ring buffer, in one process (no torchrun)."""

import time

import pytest
import torch

from megaframe.parallel import comm
from megaframe.parallel.mesh import CommStats, single_process_mesh
from megaframe.parallel.virtual import virtual_mesh
from megaframe.runops.faults import Fault, Injector, parse
from megaframe.runops.straggler import StragglerProbe
from megaframe.runops.watchdog import HANG_EXIT_CODE, Watchdog


def test_parse_faults():
    assert parse("sleep:rank=1:seconds=0.3") == [Fault("sleep", 1, None, 0.3)]
    assert parse("hang:rank=2:step=3; sleep:seconds=1:step=5") == [
        Fault("hang", 2, 3),
        Fault("sleep", None, 5, 1.0),
    ]
    assert parse("hang") == [Fault("hang", None, 1)]
    for bad in ("nap:rank=1", "sleep:rank=1", "sleep:rank=x:seconds=1", "hang:rank=1:when=3"):
        with pytest.raises(ValueError, match="MEGAFRAME_INJECT"):
            parse(bad)


def test_injector_sleeps_on_its_rank_and_step_only():
    faults = parse("sleep:rank=1:seconds=0.05:step=2")
    assert Injector(faults, 0).apply(2) == 0.0
    assert Injector(faults, 1).apply(1) == 0.0
    t0 = time.perf_counter()
    assert Injector(faults, 1).apply(2) == 0.05 and time.perf_counter() - t0 >= 0.05


def test_virtual_axes_record_collectives_without_communicating():
    mesh = virtual_mesh(tp=2, pp=1, dp=2, tp_rank=1, dp_rank=1, device="cpu")
    assert (mesh.rank, mesh.tp.ranks, mesh.dp.ranks) == (3, (2, 3), (1, 3))
    x = torch.ones(4, 3)
    assert comm.all_gather_dim0(x, mesh.tp).shape == (8, 3)
    assert comm.reduce_scatter_dim0(x, mesh.tp).shape == (2, 3)
    ops = [(e["op"], e["group"], e["ranks"], e["bytes"]) for e in mesh.stats.last()]
    assert ops == [("all_gather", "tp", (2, 3), 48), ("reduce_scatter", "tp", (2, 3), 48)]
    assert mesh.stats.pop() == {"tp": 48 + 24}


def test_watchdog_trips_writes_the_report_and_exits(tmp_path):
    stats = CommStats()
    stats.record("all_reduce", "dp", (0, 1), (16,), torch.float32, 64)
    exits = []
    dog = Watchdog(0.3, 5, str(tmp_path), stats, exit_fn=exits.append, grace_s=0).start()
    dog.beat(7)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [HANG_EXIT_CODE]
    text = (tmp_path / "hang" / "rank5.txt").read_text()
    assert "rank 5: HANG" in text and "after step 7" in text
    assert "all_reduce" in text and "group dp ranks [0, 1]" in text and "NOT RETURNED" in text
    assert "thread MainThread:" in text


def test_watchdog_fed_or_off_never_trips(tmp_path):
    exits = []
    dog = Watchdog(0.5, 0, str(tmp_path), CommStats(), exit_fn=exits.append, grace_s=0).start()
    for step in range(10):
        dog.beat(step)
        time.sleep(0.05)
    dog.stop()
    off = Watchdog(0, 0, str(tmp_path), CommStats(), exit_fn=exits.append).start()
    assert off._thread is None
    assert exits == [] and not (tmp_path / "hang").exists()


def test_straggler_probe_single_process():
    probe = StragglerProbe(Injector(parse("sleep:seconds=0.02"), 0))
    probe.begin(1)
    probe.spans.append(("F", 1.0, 1.5))
    probe.begin(2)
    figures = probe.gather(single_process_mesh())
    assert figures["straggler/slowest_rank"] == 0
    assert figures["straggler/compute_s_min"] == figures["straggler/compute_s_max"] == pytest.approx(0.27)


class _StuckEvent:
    """Stands in for a CUDA event whose collective the GPU has (or has not) got past."""

    def __init__(self, finished: bool):
        self.finished = finished

    def query(self) -> bool:
        return self.finished


def test_report_tells_enqueued_from_completed_device_collectives():
    """On NCCL a returned host call only enqueued the collective: the report must not call it done."""
    stats = CommStats()
    host = stats.record("all_reduce", "dp", (0, 1), (4,), torch.float32, 16)
    stats.returned(host, on_device=False)  # gloo: returned is done
    for finished in (True, False):
        e = stats.record("reduce_scatter", "tp", (0, 1), (8,), torch.bfloat16, 16)
        stats.returned(e)
        e["event"] = _StuckEvent(finished)
    report = Watchdog(1, 0, "/nonexistent", stats).report(2.0)
    lines = [ln for ln in report.splitlines() if " group " in ln]
    assert lines[0].endswith("returned") and "event" not in stats.last()[0]
    assert lines[1].endswith("completed on the GPU") and lines[2].endswith(
        "ENQUEUED, NOT COMPLETED on the GPU"
    )


def test_nccl_env_defaults_yield_to_the_user_and_follow_the_run_dir():
    from megaframe.parallel.launch import NCCL_DEFAULTS, nccl_env

    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}
    set_now = nccl_env("/runs/a", env)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in set_now
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == NCCL_DEFAULTS["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/a/nccl_trace/rank_"
    nccl_env("/runs/b", env)  # the ranks agreed on another run folder: our prefix moves
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/b/nccl_trace/rank_"
    user = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}
    nccl_env("/runs/c", user)
    assert user["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/scratch/fr_"


def wait_for(exits: list, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)


def test_work_between_steps_is_progress_per_batch_and_a_silent_phase_still_trips(tmp_path):
    """Validation, sampling and scoring longer than the limit, beating per batch, never trip; a phase whose
    work stops beating (a collective hung inside it) trips at the limit, its report naming the phase."""
    exits = []
    dog = Watchdog(0.4, 0, str(tmp_path), CommStats(), exit_fn=exits.append, grace_s=0).start()
    try:
        dog.beat(3)
        with dog.phase("validation at step 3"):
            for _ in range(12):  # 1.2 s of evaluation, three times the limit
                time.sleep(0.1)
                dog.beat()
        assert exits == [] and dog.doing is None and dog.step == 3
        with dog.phase("sampling at step 3"):
            wait_for(exits)
    finally:
        dog.stop()
    assert exits == [HANG_EXIT_CODE]
    text = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "(train.hang_timeout_s=0.4) in sampling at step 3 after step 3" in text, text[:300]


def test_a_phase_allowance_holds_until_the_work_switches_to_beats(tmp_path):
    """lm-eval's own work (no batches) runs under its allowance; once scoring, the hang limit again."""
    exits = []
    dog = Watchdog(0.3, 1, str(tmp_path), CommStats(), exit_fn=exits.append, grace_s=0).start()
    try:
        with dog.phase("downstream task t at step 2", 30.0):
            time.sleep(0.9)  # three times the hang limit, well inside the allowance
            assert exits == []
            dog.allow(None)
            wait_for(exits)
    finally:
        dog.stop()
    assert exits == [HANG_EXIT_CODE]
    assert "in downstream task t at step 2" in (tmp_path / "hang" / "rank1.txt").read_text()
