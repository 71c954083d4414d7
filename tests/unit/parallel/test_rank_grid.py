"""Experts folded over tp·cp·dp (Megatron's MoE parallel folding): the expert groups cut each pipeline
stage's ranks as etp (innermost), ep, edp, independently of the dense cut tp, cp, dp; HSDP's replicas
cut edp as they cut cp·dp."""

import pytest

from megaframe.parallel.rank_grid import RankGrid
from megaframe.parallel.virtual import virtual_mesh


def _partition(groups, world):
    """Every position in exactly one group."""
    return sorted(r for g in groups for r in g) == list(range(world))


def test_ep_takes_tp_peers_first():
    g = RankGrid(tp=2, dp=1, pp=1, ep=2)  # tp2 ep2 at world 2: the experts split over the tp pair
    assert g.groups("ep") == [(0, 1)] and g.groups("edp") == [(0,), (1,)]
    g = RankGrid(tp=2, dp=2, pp=1, cp=2, ep=4)  # 8 ranks: ep over tp then cp, edp over dp
    assert g.groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)] and g.groups("edp")[0] == (0, 4)


@pytest.mark.parametrize(
    "tp,cp,dp,pp,ep,etp",
    [(2, 1, 2, 2, 2, 2), (2, 2, 2, 1, 4, 2), (4, 1, 2, 1, 8, 1), (2, 1, 4, 1, 2, 1), (1, 2, 2, 1, 1, 2)],
)
def test_expert_groups_fold_each_stage(tp, cp, dp, pp, ep, etp):
    """stage_rank = etp_rank + etp·(ep_rank + ep·edp_rank): each kind of group partitions the world,
    stays inside one pipeline stage, and the etp x ep x edp coordinates name each stage rank once."""
    g = RankGrid(tp=tp, dp=dp, pp=pp, ep=ep, cp=cp, etp=etp)
    stage = tp * cp * dp
    assert g.edp == stage // (ep * etp)
    for name, size in (("etp", etp), ("ep", ep), ("edp", g.edp)):
        groups = g.groups(name)
        assert _partition(groups, g.world) and all(len(m) == size for m in groups), name
        assert all(len({r // stage for r in m}) == 1 for m in groups), name  # one stage each
    assert all(m == tuple(range(m[0], m[0] + etp)) for m in g.groups("etp"))  # etp innermost


def test_qwen3_235b_layout_folds_ep32_over_tp_and_dp():
    """Megatron-Bridge's Qwen3-235B-A22B run: tp2 pp8 ep32 on 256 ranks (dp 16, so cp x dp = 16 < 32)."""
    g = RankGrid(tp=2, dp=16, pp=8, ep=32)
    assert g.edp == 1 and g.groups("ep")[0] == tuple(range(32))
    mesh = virtual_mesh(2, 8, 16, tp_rank=1, dp_rank=3, pp_rank=5, ep=32, device="meta")
    assert (mesh.ep.size, mesh.ep.rank, mesh.edp.size, mesh.etp.size) == (32, 7, 1, 1)
    assert mesh.experts_folded and mesh.dpcp.size == 16


def test_hsdp_replicas_cut_edp_as_they_cut_cp_dp():
    g = RankGrid(tp=1, dp=4, pp=1, ep=2, shard=2)  # 2 replicas; edp = 2: one expert shard rank each
    assert g.groups("dp_shard") == [(0, 1), (2, 3)] and g.groups("dp_rep") == [(0, 2), (1, 3)]
    assert g.groups("edp_shard") == [(0,), (2,), (1,), (3,)] and g.groups("edp_rep") == [(0, 2), (1, 3)]
    g = RankGrid(tp=2, dp=4, pp=1, ep=2, shard=2)  # edp = 4 over 2 replicas: shard blocks of 2
    assert g.groups("edp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert g.groups("edp_shard") == [(0, 2), (4, 6), (1, 3), (5, 7)]
    mesh = virtual_mesh(1, 1, 4, dp_rank=1, ep=2, shard=2, device="meta")
    assert (mesh.edp_shard.size, mesh.edp_rep.size) == (1, 2)
    plain = virtual_mesh(1, 1, 4, dp_rank=1, shard=2, device="meta")  # ep = 1: experts as dense
    assert plain.edp_shard is plain.dp_shard and plain.edp_rep is plain.dp_rep


def test_unfolded_experts_keep_the_dense_axes():
    mesh = virtual_mesh(2, 1, 2, tp_rank=1, device="meta")
    assert not mesh.experts_folded and mesh.edp is mesh.dpcp and mesh.etp.size == 1


def test_dispatch_by_node_cuts_each_ep_group_into_its_nodes_and_rails():
    """ep_node: an ep group's members on one node (consecutive ep ranks); ep_rail: one per node at the same
    place of it, in node order (its rank is the node's index in the group)."""
    g = RankGrid(tp=2, dp=8, pp=1, ep=16, node=8)  # Qwen3-30B-A3B's ep16 on two 8-GPU nodes, tp2 folded in
    assert g.groups("ep_node") == [tuple(range(8)), tuple(range(8, 16))]
    assert g.groups("ep_rail") == [(i, i + 8) for i in range(8)]
    g = RankGrid(tp=2, dp=4, pp=1, ep=4, node=2)  # two ep groups over tp·dp, two nodes each
    assert g.groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert g.groups("ep_node") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g.groups("ep_rail") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    # its rows are not gathered over etp: the experts' slices would run on them alone
    with pytest.raises(ValueError, match="parallel.etp=1"):
        RankGrid(tp=1, dp=8, pp=1, ep=4, etp=2, node=4)
    assert "ep_rail" in g.creation_order() and "ep_rail" not in RankGrid(1, 8, 1, ep=4).creation_order()
    with pytest.raises(ValueError, match="same ranks on each of its nodes"):
        RankGrid(tp=1, dp=6, pp=1, ep=6, node=4)


def test_the_node_size_is_the_launchers_unless_set_and_is_checked_before_any_group():
    from megaframe.config import ConfigError, load_config
    from megaframe.parallel.launch import dispatch_node

    over = ["model=moe_tiny", "parallel.ep=4", "parallel.ep_dispatch=node"]
    p = load_config(over, world_size=4, check_data=False).parallel
    assert dispatch_node(p, 4, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert dispatch_node(p, 4, {"SLURM_STEP_TASKS_PER_NODE": "2"}) == 2
    p = load_config([*over, "parallel.ranks_per_node=2"], world_size=4, check_data=False).parallel
    assert dispatch_node(p, 4, {"LOCAL_WORLD_SIZE": "4"}) == 2
    plain = load_config(over[:2], world_size=4, check_data=False).parallel
    assert dispatch_node(plain, 4, {"LOCAL_WORLD_SIZE": "2"}) == 0
    p = load_config(over, world_size=4, check_data=False).parallel
    with pytest.raises(ConfigError, match=r"parallel.ranks_per_node=0 \(3: the launcher's\)"):
        dispatch_node(p, 4, {"LOCAL_WORLD_SIZE": "3"})
    # the whole ep group on one node: no node axes (the plain all-to-all, no extra process groups)
    assert dispatch_node(p, 4, {"LOCAL_WORLD_SIZE": "4"}) == 0


def test_the_nodes_are_counted_from_every_ranks_host_alike_on_every_rank():
    """Counted from the hosts (one gather at start-up), every rank cuts the groups alike: the launcher's
    LOCAL_WORLD_SIZE is each rank's own, and a node given fewer ranks would cut them otherwise. A cyclic
    rank layout, or nodes with different numbers of ranks, is refused in one line."""
    from megaframe.config import ConfigError, load_config
    from megaframe.parallel.launch import dispatch_node, ranks_per_host

    assert ranks_per_host(["a", "a", "b", "b"]) == 2 and ranks_per_host(["a"] * 4) == 4
    over = ["model=moe_tiny", "parallel.ep=4", "parallel.ep_dispatch=node"]
    p = load_config(over, world_size=4, check_data=False).parallel
    # this rank's launcher says 4 a node; the hosts say 2: the hosts win, on every rank
    assert dispatch_node(p, 4, {"LOCAL_WORLD_SIZE": "4"}, hosts=["a", "a", "b", "b"]) == 2
    with pytest.raises(ConfigError, match=r"host a holds ranks \[0, 2\], not consecutive"):
        dispatch_node(p, 4, {}, hosts=["a", "b", "a", "b"])
    with pytest.raises(ConfigError, match="different numbers of ranks"):
        dispatch_node(p, 4, {}, hosts=["a", "a", "a", "b"])
    # parallel.ranks_per_node overrides the hosts (the CPU tests emulate two nodes on one host)
    p = load_config([*over, "parallel.ranks_per_node=2"], world_size=4, check_data=False).parallel
    assert dispatch_node(p, 4, {}, hosts=["a"] * 4) == 2
