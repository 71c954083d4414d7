"""train.dist_timeout_s reaches every group of the mesh (new_group does not inherit init_process_group's
timeout), and checkpoint.save_timeout_s the world group that checkpoint barriers use."""

import datetime

import pytest
import torch

pytestmark = pytest.mark.distributed


def group_timeouts(mesh, timeout_s: float, world_timeout_s: float) -> dict | None:
    """Build a tp2·pp2 mesh over all 4 pool ranks with the given timeouts; rank 0 returns each group's."""
    from megaframe.parallel.mesh import build_mesh

    m = build_mesh(
        2,
        2,
        torch.device("cpu"),
        timeout=datetime.timedelta(seconds=timeout_s),
        world_timeout=datetime.timedelta(seconds=world_timeout_s),
    )

    def seconds(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    out = {name: seconds(getattr(m, name).group) for name in ("tp", "pp", "pp_ends")}
    out["world"] = seconds(m.group)
    return out if mesh.rank == 0 else None


def test_mesh_groups_take_the_configured_timeouts(pool):
    got = pool.run(group_timeouts, 4, 37.0, 91.0)[0]
    assert got == {"tp": 37.0, "pp": 37.0, "pp_ends": 37.0, "world": 91.0}, got


def stop_flag_group(mesh, world_timeout_s: float) -> dict | None:
    """On a CUDA mesh (the device only decides the flag's group here), the stop flag's group and the
    world group's backend; the mesh's groups are gloo on the pool."""
    import dataclasses

    import torch.distributed as dist

    from megaframe.parallel import mesh as mesh_mod
    from megaframe.runops.signals import StopFlag

    backends, real = [], dist.new_group

    def recording(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    mesh_mod.dist.new_group = recording
    try:
        m = mesh_mod.build_mesh(
            1, 1, torch.device("cpu"), world_timeout=datetime.timedelta(seconds=world_timeout_s)
        )
    finally:
        mesh_mod.dist.new_group = real
    stop = StopFlag()
    try:
        stop.decide(dataclasses.replace(m, device=torch.device("cuda")))
    finally:
        stop.restore()
    timeout = stop.group.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return {"flag": timeout, "world_backend": backends[-1]} if mesh.rank == 0 else None


def test_stop_flag_and_world_group_are_gloo_with_the_configured_timeout(pool):
    """#10: on CUDA the stop flag's gloo twin was made without a timeout (gloo's 30 minutes); #16: the
    world group was a second NCCL communicator over every rank, for host-side decisions only. Now the
    world group is gloo with checkpoint.save_timeout_s, and the flag is reduced over it."""
    got = pool.run(stop_flag_group, 4, 91.0)[0]
    assert got == {"flag": 91.0, "world_backend": "gloo"}, got


def first_step_timeouts(mesh, lanes: int = 1) -> dict | None:
    """tp2·pp2 with dist_timeout_s=37: the groups' and the watchdog's limits inside and after the
    first-step context (compile_timeout_s=500); `lanes` 2: tp's twin (the overlapped kinds) among them."""
    from megaframe.parallel.mesh import CommStats, build_mesh
    from megaframe.runops.watchdog import Watchdog
    from megaframe.training.first_step import first_step_limits, step_groups

    m = build_mesh(2, 2, torch.device("cpu"), timeout=datetime.timedelta(seconds=37), lanes=lanes)
    dog = Watchdog(0, mesh.rank, "/nonexistent", CommStats())

    def seconds():
        return sorted(
            {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in step_groups(m)}
        )

    with first_step_limits(m, dog, 500.0, 37.0):
        inside = (seconds(), dog.override)
    return (
        {"inside": inside, "after": (seconds(), dog.override), "groups": len(step_groups(m))}
        if mesh.rank == 0
        else None
    )


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_compiled_first_step_gets_the_compile_timeout_then_the_usual_one(pool, lanes):
    """#15: at large pp, stage k's first receives wait while stages 0..k-1 compile in turn; NCCL counts
    from enqueue, so step 1 could outlast train.dist_timeout_s and train.hang_timeout_s. Under an
    overlapped kind the second lane's communicators get the compile timeout too."""
    got = pool.run(first_step_timeouts, 4, lanes)[0]
    assert got == {"inside": ([500.0], 500.0), "after": ([37.0], None), "groups": 2 + lanes}, got
