"""GPU-path launch and kernel rules checked on CPU: the mixed-dtype GEMM probe and its fallback, multi-node
srun addresses, the flight recorder's folder, NCCL emulated on gloo only, async-save staging, fused ring
attention's causal pairs, more ranks than GPUs refused."""

import torch

from megaframe.layers import fused_ce


def _bf16_head_grad(n=1024, d=16, v=4096):  # two CPU chunks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, d, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(v, d, generator=g) * 0.05).bfloat16().requires_grad_(True)
    t = torch.randint(0, v, (n, 1), generator=g)
    fused_ce.linear_cross_entropy(x, w, t).sum().backward()
    return w.grad.float()


def test_mixed_gemm_probe_falls_back_on_a_torch_without_the_out_dtype_overloads(monkeypatch):
    """#1: torch 2.6/2.7 have no mm/addmm(..., out_dtype) (TypeError), 2.8/2.9 refuse an fp32 `self`
    (RuntimeError): the probe says no and the head grad upcasts instead of dying on step 1."""
    real_mm, real_addmm = torch.mm, torch.addmm

    def old_mm(*args, **kwargs):
        if len(args) > 2:
            raise TypeError("mm() received an invalid combination of arguments")
        return real_mm(*args, **kwargs)

    def old_addmm(*args, **kwargs):
        if len(args) > 3:
            raise RuntimeError("self and mat2 must have the same dtype")
        return real_addmm(*args, **kwargs)

    fused_ce.mixed_gemm.cache_clear()
    monkeypatch.setattr(torch, "mm", old_mm)
    assert fused_ce.mixed_gemm("cpu") is False
    fused_ce.mixed_gemm.cache_clear()
    monkeypatch.setattr(torch, "mm", real_mm)
    monkeypatch.setattr(torch, "addmm", old_addmm)
    assert fused_ce.mixed_gemm("cpu") is False
    fused_ce.mixed_gemm.cache_clear()
    monkeypatch.undo()
    assert fused_ce.mixed_gemm("cpu") is False  # the CPU wheel has no kernel for the overloads either
    fused_ce.mixed_gemm.cache_clear()


def test_the_mixed_gemm_path_is_chosen_by_the_probe_and_equals_the_fallback(monkeypatch):
    """With the probe forced on, the bf16 head grad goes through the out_dtype overloads (emulated here
    as the fp32 GEMM cuBLAS runs) and equals the upcasting fallback, which runs with the probe off."""
    fallback = _bf16_head_grad()
    real_mm, real_addmm, calls = torch.mm, torch.addmm, []

    def mm(a, b, *dtype, out=None):
        if dtype:
            calls.append("mm")
            return out.copy_(real_mm(a.float(), b.float()))
        return real_mm(a, b, out=out) if out is not None else real_mm(a, b)

    def addmm(acc, a, b, *dtype, out=None):
        calls.append("addmm")
        return out.copy_(real_addmm(acc, a.float(), b.float()))

    monkeypatch.setattr(fused_ce, "mixed_gemm", lambda device_type: True)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    mixed = _bf16_head_grad()
    assert calls[:2] == ["mm", "addmm"], calls
    torch.testing.assert_close(mixed, fallback, rtol=0, atol=0)


def test_plain_multi_node_srun_dials_the_first_node_not_the_loopback():
    """#5: `srun python train.py` on two nodes without MASTER_ADDR: every node used to dial its own
    127.0.0.1 until dist_timeout_s; now the first node of the step, or a one-line error."""
    from megaframe.errors import ConfigError
    from megaframe.parallel.launch import master_addr

    assert (
        master_addr({"SLURM_NNODES": "2", "SLURM_PROCID": "9", "SLURM_JOB_NODELIST": "gpu[007-010,12],c1"})
        == "gpu007"
    )
    step = {
        "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "r[2-3]-n[05-06]",
        "SLURM_JOB_NODELIST": "r[1-3]-n[01-08]",
    }
    assert master_addr(step) == "r2-n05"  # task 0 runs on the step's first node
    assert master_addr({"SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu1"}) == "127.0.0.1"
    assert master_addr({}) == "127.0.0.1"
    try:
        master_addr({"SLURM_NNODES": "2", "SLURM_PROCID": "9"})
        raise AssertionError("no error")
    except ConfigError as e:
        assert "MASTER_ADDR" in str(e) and "SLURM_NNODES=2" in str(e)


def test_flight_recorder_dump_folder_exists_before_the_first_collective(tmp_path):
    """#9: the dump prefix pointed at each rank's own, not yet agreed, run.dir/nccl_trace/ and nobody
    created it before build_mesh: a hang there left no dump. Now rank 0's folder, created at init."""
    from megaframe.parallel.launch import early_dump_dir

    store = torch.distributed.HashStore()
    env0, env1 = {}, {}
    assert early_dump_dir(store, 0, str(tmp_path / "run-a"), env0) == str(tmp_path / "run-a")
    assert early_dump_dir(store, 1, str(tmp_path / "run-b"), env1) == str(tmp_path / "run-a")
    for env in (env0, env1):
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/run-a/nccl_trace/rank_"
    assert (tmp_path / "run-a" / "nccl_trace").is_dir() and not (tmp_path / "run-b").exists()


def test_the_suite_runs_its_commands_on_cpu_unless_a_test_asks_for_cuda(monkeypatch):
    """#6a: e2e and Slurm commands left train.device=auto, so on a GPU host 2-4 torchrun ranks shared one
    GPU (NCCL does not support that); now they see no GPU unless the test names train.device=cuda."""
    import subprocess

    from tests.e2e import helpers
    from tests.slurm.helpers import job_env

    assert helpers.env()["CUDA_VISIBLE_DEVICES"] == "" and job_env()["CUDA_VISIBLE_DEVICES"] == ""
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: seen.append(k["env"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    # every command through subprocess.run, where its environment is seen (a warm fork gets the same env())
    monkeypatch.setenv("MEGAFRAME_TEST_FORK", "0")
    helpers.train(["train.max_steps=1"], nproc=2)
    helpers.train(["train.device=cuda"])
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "" and seen[1]["CUDA_VISIBLE_DEVICES"] == "3"


def test_nccl_semantics_are_emulated_on_gloo_only(monkeypatch):
    """#6b: the conftest's MEGAFRAME_P2P_SEMANTICS=nccl reached GPU ranks, whose emulated pp stream sent a
    CPU "ready" tensor over the NCCL group; an NCCL group keeps its own (real) semantics."""
    from megaframe.parallel import p2p_semantics

    group = object()
    monkeypatch.setattr(p2p_semantics.dist, "get_backend", lambda g: "nccl")
    assert p2p_semantics.stream_for(group, emulate=True) is None
    monkeypatch.setattr(p2p_semantics.dist, "get_backend", lambda g: "gloo")
    monkeypatch.setattr(p2p_semantics, "group_timeout_s", lambda g: 5.0)
    assert isinstance(p2p_semantics.stream_for(group, emulate=True), p2p_semantics.NcclStream)
    assert p2p_semantics.stream_for(group, emulate=False) is None


def test_a_p2p_batch_is_marked_done_through_stats_returned(monkeypatch):
    """#8: p2p batches were marked done by hand, so no CUDA event was recorded and the watchdog called a
    batch NCCL still ran "returned"; now the last wait goes through CommStats.returned like a collective."""
    from megaframe.parallel import comm
    from megaframe.parallel.mesh import Axis, CommStats

    class Work:
        def wait(self, *args, **kwargs):
            return True

    calls = []

    class Stats(CommStats):
        def returned(self, entry, on_device=False):
            calls.append(on_device)
            super().returned(entry, on_device)

    stats = Stats()
    axis = Axis("pp", 2, 0, (0, 1), object(), stats)
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: [Work(), Work()])
    monkeypatch.setattr(comm.dist, "P2POp", lambda *a, **k: None)
    works = comm.batch_isend_irecv(axis, [(torch.ones(2), 1)], [(torch.empty(2), 1)])
    works[0].wait()
    assert calls == [] and stats.last()[-1]["done"] is False
    works[1].wait()
    works[1].wait()  # a second wait changes nothing
    assert calls == [False] and stats.last()[-1]["done"] is True


def test_async_save_staging_is_one_buffer_of_the_exact_total_reused_by_every_save():
    """#12: each stored tensor got its own pinned block, which torch's host allocator rounds up to a power
    of two and keeps for the run (up to ~2x the share held page-locked). Now one buffer, the sum of the
    (64-byte aligned) sizes, registered once and reused by the next save."""
    from megaframe.checkpoint.staging import PinnedStaging

    registered, released = [], []
    staging = PinnedStaging(
        register=lambda b: registered.append(b.numel()) or True, unregister=released.append
    )
    ts = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int64),
        torch.ones(0, 2),
        torch.randn(129).bfloat16(),
    ]
    views = staging.views(ts)
    for v, t in zip(views, ts):
        assert v.shape == t.shape and v.dtype == t.dtype
        v.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(views, ts))
    assert staging.nbytes == 64 + 64 + 0 + 258 and registered == [staging.nbytes]  # not 128+64+0+512
    first = [v.data_ptr() for v in views]
    assert [v.data_ptr() for v in staging.views(ts)] == first and staging.allocations == 1  # the next save
    staging.views(ts + [torch.randn(100)])  # a larger share: one new buffer, the old one released
    assert staging.allocations == 2 and len(released) == 1


def fused_ring_vs_sdpa(device: str, dtype, b=2, h=4, k=2, s=64, e=16) -> float:
    """The fused ring of one rank (no exchange: c = 1, the rank's two chunks make the whole sequence)
    against SDPA causal attention: max relative error over out, dq, dk, dv."""
    import torch.nn.functional as F

    from megaframe.parallel.mesh import Axis, CommStats
    from megaframe.parallel.ring_fused import FusedRing

    g = torch.Generator(device=device).manual_seed(0)
    q, kk, vv = (
        torch.randn(b, n, s, e, generator=g, device=device).to(dtype).requires_grad_(True) for n in (h, k, k)
    )
    go = torch.randn(b, h, s, e, generator=g, device=device).to(dtype)
    axis = Axis("cp", 1, 0, (0,), None, CommStats())
    out = FusedRing.apply(q, kk, vv, axis, True, lambda a, x: (x.clone(), []), lambda works: None)
    got = [out] + list(torch.autograd.grad(out, (q, kk, vv), go))
    ref_q, ref_k, ref_v = (t.detach().float().requires_grad_(True) for t in (q, kk, vv))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, enable_gqa=True)
    want = [ref] + list(torch.autograd.grad(ref, (ref_q, ref_k, ref_v), go.float()))
    return max(((a.float() - r).norm() / r.norm()).item() for a, r in zip(got, want))


def test_fused_ring_chunk_pairs_make_causal_attention():
    """#7: one rank's two chunks through the fused ring's chunk pairs (causal diagonal, full below)
    equal SDPA causal attention on the whole sequence, forward and backward (GQA 2:1)."""
    assert fused_ring_vs_sdpa("cpu", torch.float32) <= 1e-5


def test_more_ranks_than_gpus_on_a_node_is_refused(monkeypatch):
    """#6a for users: `torchrun --nproc-per-node=2` on a one-GPU host put both ranks on cuda:0, which NCCL
    does not support (a hang); now one line naming the counts."""
    from megaframe.errors import ConfigError
    from megaframe.parallel import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        launch.pick_device("auto", 1)
        raise AssertionError("no error")
    except ConfigError as e:
        assert "2 ranks on this node but 1 GPU(s)" in str(e)
    assert launch.local_world_size({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert launch.local_world_size({"SLURM_NTASKS_PER_NODE": "8"}) == 1  # plain python in an allocation
    assert launch.local_world_size({}) == 1
