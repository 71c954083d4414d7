"""train.dist_timeout_s reaches every group of the mesh (new_group does not inherit init_process_group's
timeout), and checkpoint.save_timeout_s the world group that checkpoint barriers use."""
import datetime

import pytest
import torch

pytestmark = pytest.mark.distributed


def group_timeouts(mesh, timeout_s: float, world_timeout_s: float) -> dict | None:
    """Build a tp2·pp2 mesh over all 4 pool ranks with the given timeouts; rank 0 returns each group's."""
    from megaframe.parallel.mesh import build_mesh

    m = build_mesh(2, 2, torch.device("cpu"), timeout=datetime.timedelta(seconds=timeout_s),
                   world_timeout=datetime.timedelta(seconds=world_timeout_s))

    def seconds(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    out = {name: seconds(getattr(m, name).group) for name in ("tp", "pp", "pp_ends")}
    out["world"] = seconds(m.group)
    return out if mesh.rank == 0 else None


def test_mesh_groups_take_the_configured_timeouts(pool):
    got = pool.run(group_timeouts, 4, 37.0, 91.0)[0]
    assert got == {"tp": 37.0, "pp": 37.0, "pp_ends": 37.0, "world": 91.0}, got
