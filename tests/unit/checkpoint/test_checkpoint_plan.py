"""Read plans at scale without the hardware: the metadata of a checkpoint as every rank of a large layout
would write it (meta models: no tensor data), and the read plan of every rank of another layout.

Claims (each a count asserted against theory, for every rank, computed in one process):
- the saved pieces tile every logical tensor exactly once (the commit's coverage check);
- every byte a loading rank needs is planned exactly once (the planner refuses a gap or overlap per
  needed box, and the destination boxes of the plan do not overlap);
- a rank's planned bytes are its share within 10 %: its whole local slice of the weights plus 1/dp of
  its moments (ZeRO-1), and the share itself matches that count;
- planning every rank takes under a minute on this machine (2 shared cores).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from megaframe.checkpoint.layout import needs
from megaframe.checkpoint.metadata import _overlaps, check_coverage
from megaframe.checkpoint.offline_plans import Layout, load_needs, saved_metadata
from megaframe.checkpoint.read_plan import Index, plan_reads
from megaframe.config import load_config

CASES = {
    "llama3_8b": (Layout(tp=8, pp=4, dp=8), Layout(tp=4, pp=2, dp=32)),
    "mixtral_8x7b": (Layout(tp=2, pp=4, dp=8, ep=8), Layout(tp=2, pp=8, dp=4, ep=4)),
}


def config(model: str, layout: Layout):
    return load_config(
        [
            f"model={model}",
            "data=synthetic",
            "train.global_batch_size=1024",
            "train.micro_batch_size=1",
            f"parallel.tp={layout.tp}",
            f"parallel.pp={layout.pp}",
            f"parallel.ep={layout.ep}",
        ],
        world_size=layout.world,
        check_data=False,
    )


@pytest.mark.parametrize("model", list(CASES))
def test_every_rank_of_another_layout_reads_its_share_once(model):
    save, load = CASES[model]
    tensors, written = saved_metadata(config(model, save), save)
    check_coverage(tensors)
    total = sum(written.values())
    index = Index(tensors)
    planning, worst, shares = 0.0, 0.0, []
    for rank, items, share in load_needs(config(model, load), load):
        t0 = time.perf_counter()
        plan = plan_reads(index, needs(items))
        planning += time.perf_counter() - t0
        assert plan.needed_bytes == share
        worst = max(worst, plan.planned_bytes / share - 1)
        # theory: the local slice of every weight, and 1/dp
        # (1/edp for experts) of its fp32 moments (and master)
        theory = 0
        for it in items:
            n = math.prod(it.local_shape) * it.itemsize
            theory += n if it.key.startswith("model/") else 0
        moments = sum((hi - lo) * 4 for it in items if it.key.startswith("optim/") for lo, hi in it.held)
        weights_fp32 = sum(math.prod(it.local_shape) * 4 for it in items if it.key.startswith("model/"))
        dp = load.dp // load.ep if any(".experts." in it.key for it in items) and load.ep > 1 else load.dp
        # two fp32 moments, and an fp32 master where the params are bf16 (build_model: train.precision)
        kinds = 3 if any(it.key.startswith("optim/master/") for it in items) else 2
        assert (
            kinds * weights_fp32 / load.dp * 0.5
            <= moments
            <= kinds * weights_fp32 / min(dp, load.dp // load.ep) * 1.01
        )
        assert share == theory + moments
        shares.append(share)
        if (
            rank % 37 == 0
        ):  # the destination boxes of a plan never overlap (exactly once, checked in full here)
            for key, _sid, _src, dst, size in plan.copies:
                assert not _overlaps(dst, dst + size), (rank, key)
    print(
        f"\n{model}: saved at {save} ({total / 1e9:.2f} GB, {save.world} files, per rank "
        f"{min(written.values()) / 1e9:.3f}-{max(written.values()) / 1e9:.3f} "
        f"GB); planned every rank of {load} "
        f"({load.world} ranks) in {planning:.1f}s; share {min(shares) / 1e9:.3f}-{max(shares) / 1e9:.3f} GB "
        f"per rank; planned bytes at most {worst:.2%} over the share"
    )
    assert worst <= 0.10
    assert planning < 60


def test_a_gap_or_an_overlap_in_the_metadata_is_refused_at_plan_time():
    from megaframe.checkpoint.metadata import CheckpointError

    save = Layout(tp=2, pp=1, dp=2)
    cfg = load_config(
        [
            "data=synthetic",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=8",
            "model.num_query_groups=4",
            "model.ffn_hidden_size=128",
            "model.vocab_size=256",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "parallel.tp=2",
        ],
        world_size=4,
        check_data=False,
    )
    tensors, _ = saved_metadata(cfg, save)
    items = next(iter(load_needs(cfg, save)))[1]
    key = "model/layers.0.attn.qkv.weight"
    gap = {**tensors, key: {**tensors[key], "shards": tensors[key]["shards"][1:]}}
    with pytest.raises(CheckpointError, match="coverage|gap|elements"):
        check_coverage(gap)
    with pytest.raises(CheckpointError, match="a gap"):
        plan_reads(Index(gap), needs(items))
    over = {**tensors, key: {**tensors[key], "shards": tensors[key]["shards"] + tensors[key]["shards"][:1]}}
    with pytest.raises(CheckpointError, match="overlap"):
        check_coverage(over)
    with pytest.raises(CheckpointError, match="overlapping"):
        plan_reads(Index(over), needs(items))
    assert np.all(True)
