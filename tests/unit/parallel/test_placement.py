"""The Placement record over every rank of a layout, computed in one process on virtual meshes: each
element of every parameter is written to a checkpoint exactly once and counted in the grad norm exactly
once per data-parallel replica; the tied embedding's copies are marked on the pipeline ends only."""

import pytest
import torch

from megaframe.parallel.virtual import virtual_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model

# (overrides, tp, pp, dp, ep); etp from the overrides
LAYOUTS = [
    (["model=gpt2_tiny", "model.num_query_groups=null"], 2, 2, 2, 1),  # tied embeddings across pp
    ([], 2, 2, 2, 1),  # untied
    (
        ["model.family=mixtral", "model.num_experts=4", "parallel.sp=true"],
        2,
        1,
        4,
        2,
    ),  # experts folded: ep over the tp pair, edp over dp
    (["model.family=mixtral", "model.num_experts=4", "parallel.sp=true"], 2, 1, 2, 4),  # ep over tp x dp
    (["model.family=mixtral", "model.num_experts=4", "parallel.sp=true"], 2, 1, 2, 1),  # replicated over tp
    (["model.family=mixtral", "model.num_experts=4", "parallel.sp=true", "parallel.etp=2"], 2, 2, 2, 2),
]


def _every_rank(overrides, tp, pp, dp, ep):
    over = overrides + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}"]
    cfg = tiny_config(over, tp * pp * dp)
    etp = cfg.parallel.etp
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                mesh = virtual_mesh(tp, pp, dp, t, p, d, device="meta", ep=ep, etp=etp)
                yield cfg, mesh, build_model(cfg, mesh)


def _cover(counts: dict, name: str, placement) -> None:
    shard = placement.shard
    full = counts.setdefault(name, torch.zeros(shard.global_shape, dtype=torch.int32))
    # the positions of this rank's slice (its inner etp split included), each counted once
    where = shard.local(torch.arange(full.numel()).view(full.shape))
    full.view(-1)[where.flatten()] += 1


@pytest.mark.parametrize("overrides,tp,pp,dp,ep", LAYOUTS)
def test_each_element_written_once_and_counted_once_per_replica(overrides, tp, pp, dp, ep):
    written, normed, tied = {}, {}, []
    for cfg, mesh, model in _every_rank(overrides, tp, pp, dp, ep):
        for name, p in model.named_parameters():
            pl = p.placement
            if pl.writes_checkpoint(mesh):
                _cover(written, name, pl)
            if pl.counts_in_norm(mesh) and pl.data_axis(mesh).rank == 0:
                _cover(normed, name, pl)
            if pl.pp_tied:
                tied.append((mesh.pp.rank, name, pl.pp_duplicate))
            # folded experts are no tp copies (their tp peers are ep or edp peers): no tp-partial grad
            partial = mesh.tp.size > 1 and cfg.parallel.sp and not pl.tp_split and not pl.expert_folded
            assert pl.tp_partial_grad == partial
    assert written and all(bool((c == 1).all()) for c in written.values()), {
        k: c.unique().tolist() for k, c in written.items()
    }
    assert all(bool((c == 1).all()) for c in normed.values())
    if cfg.model.tie_embeddings and pp > 1:  # both ends, the last one the duplicate, on every (dp, tp)
        assert sorted(set(tied)) == [(0, "embed.weight", False), (pp - 1, "embed.weight", True)]
        assert len(tied) == 2 * dp * tp
    else:
        assert not tied
