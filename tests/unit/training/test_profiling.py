"""train.profile_steps and train.memory_snapshot (training/profiling.py): which steps a trace covers, the
memory snapshots' CUDA calls (injected: this suite has no GPU), the out-of-memory snapshot, the ranges'
null context when off, the injected kill's parsing, the config keys' refusals."""

from __future__ import annotations

import pytest
import torch

from megaframe.config import ConfigError, load_config
from megaframe.parallel.observe import NULL, Observer, action_range, named
from megaframe.runops.faults import Fault, parse
from megaframe.training.profiling import MemorySnapshots, Watch, runs_of


class FakeCuda:
    def __init__(self):
        self.calls = []

    def record(self, on):
        self.calls.append(("record", on))

    def dump(self, path):
        self.calls.append(("dump", path.rsplit("/", 1)[-1]))


def test_consecutive_steps_are_one_trace():
    assert runs_of([3, 4, 9, 7, 8, 3]) == {3: 4, 7: 9}
    assert runs_of([]) == {}


def test_memory_snapshots_record_from_the_first_chosen_step_and_dump_each(tmp_path):
    cuda = FakeCuda()
    snaps = MemorySnapshots([2, 4], str(tmp_path), 3, torch.device("cuda", 0), cuda)
    for step in range(1, 6):
        snaps.begin(step)
        snaps.end(step)
    assert cuda.calls == [
        ("record", True),
        ("dump", "memory_rank3_step2.pickle"),
        ("dump", "memory_rank3_step4.pickle"),
        ("record", False),
    ]


def test_an_out_of_memory_error_writes_a_snapshot_and_goes_on(tmp_path):
    cuda = FakeCuda()
    watch = Watch.__new__(Watch)  # its parts only: no mesh needed
    watch.prof = type("P", (), {"begin": lambda s, n: None, "end": lambda s, n: None, "prof": None})()
    watch.mem = MemorySnapshots([], str(tmp_path), 0, torch.device("cuda", 0), cuda)
    watch.observer, watch._step, watch._exported = Observer(), 0, False
    with pytest.raises(torch.OutOfMemoryError), watch.step(5):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert cuda.calls == [("dump", "memory_rank0_oom.pickle")]


def test_cpu_runs_make_no_cuda_call(tmp_path, capsys):
    cuda = FakeCuda()
    snaps = MemorySnapshots([1], str(tmp_path), 0, torch.device("cpu"), cuda)
    snaps.begin(1), snaps.end(1), snaps.oom()
    assert cuda.calls == [] and "CUDA only" in capsys.readouterr().err


def test_ranges_off_hand_back_the_shared_null_context():
    class Stats:
        observer = Observer()

    assert named(Stats, "optimizer_step") is NULL and action_range(Stats, "F", 0, 0, False) is NULL
    Stats.observer.ranges = True
    assert named(Stats, "optimizer_step") is not NULL and Stats.observer.ranges_opened == 1


def test_the_kill_fault_and_the_profile_keys():
    assert parse("kill:rank=0:step=6") == [Fault("kill", 0, 6)]
    assert parse("kill") == [Fault("kill", None, 1)]
    for bad in ("train.profile_steps=[0]", "train.memory_snapshot=[-2]"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace("[", r"\[")):
            load_config(["data=synthetic", bad], world_size=1, check_data=False)


def test_an_overlapped_kinds_worker_thread_is_in_the_trace(tmp_path):
    """An overlapped pipeline kind runs each pair's forward on a worker thread: its ops are in the trace
    (told to record every thread), where by default the profiler records the thread that started it only."""
    import gzip
    import json
    import threading

    import torch

    from megaframe.parallel.observe import Observer
    from megaframe.training.profiling import StepProfiler

    def worker_ops(all_threads: bool) -> int:
        prof = StepProfiler(
            [1], str(tmp_path / str(all_threads)), 0, Observer(), torch.device("cpu"), all_threads
        )
        prof.begin(1)
        main = threading.get_native_id()
        t = threading.Thread(target=lambda: torch.mm(torch.ones(8, 8), torch.ones(8, 8)))
        t.start()
        t.join()
        trace = json.load(gzip.open(prof.end(1)))["traceEvents"]
        return sum(1 for e in trace if e.get("name") == "aten::mm" and e.get("tid") != main)

    assert worker_ops(True) == 1 and worker_ops(False) == 0
