"""Context parallelism trains the tiny models exactly like one process: losses, grads, weights; and the
cp all-gather moves exactly the bytes of the theory."""

import pytest

from tests.distributed.cases import train_and_report
from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close

pytestmark = pytest.mark.distributed

# three steps: step 1's loss and grads, then two updates (the second reads Adam moments and any state the
# cp exchange kept from the step before) and the weights after three; more steps repeat the same exchange
STEPS = 3
GPT2 = ["model=gpt2_tiny", "model.num_query_groups=null"]
_reference: dict = {}


def reference(pool, family: tuple):
    if family not in _reference:
        _reference[family] = pool.run(train_and_report, 1, list(family), STEPS)[0]
    return _reference[family]


def check(got, ref):
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(got["weights"], ref["weights"])


# (cp, tp, dp, sp, zero, family)
LAYOUTS = [
    (2, 1, 1, False, 0, ()),
    (4, 1, 1, False, 0, ()),
    (2, 2, 1, True, 0, ()),
    (2, 1, 2, False, 1, ()),
    (2, 1, 1, False, 0, tuple(GPT2)),
]


@pytest.mark.parametrize(
    "cp,tp,dp,sp,zero,family", LAYOUTS, ids=["cp2", "cp4", "cp2-tp2-sp", "cp2-dp2-zero1", "gpt2-cp2"]
)
def test_cp_matches_one_process(pool, cp, tp, dp, sp, zero, family):
    ref = reference(pool, family)
    over = list(family) + [
        f"parallel.cp={cp}",
        f"parallel.tp={tp}",
        f"parallel.sp={str(sp).lower()}",
        f"optim.zero={zero}",
    ]
    got = pool.run(train_and_report, cp * tp * dp, over, STEPS, tp=tp, cp=cp)[0]
    check(got, ref)


@pytest.mark.parametrize("kind,recompute", [("allgather", "none"), ("ring", "none")])
@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 1), (2, 2)])
def test_cp_bytes_match_theory(pool, cp, tp, kind, recompute):
    """comm_bytes/cp of one step, to the byte, against context.cp_bytes_per_layer (the planner's figure)
    per layer and micro-batch, and against the theory written out here. allgather: forward all-gathers
    K and V ((c-1) x this rank's block each), backward reduce-scatters their grads ((c-1)/c of the gathered
    [S, B, K/tp, E] each, the same bytes). ring: c-1 sends of the K/V pair forward, c-1 again in backward,
    plus c sends of the travelling fp32 dK/dV pair (the last brings it home). Nothing else crosses the cp
    axis (grads go over cp·dp: 'dp')."""
    check_cp_bytes(pool, cp, tp, kind, recompute)


@pytest.mark.parametrize(
    "kind,recompute",
    [
        ("allgather", "full"),
        ("allgather", "selective"),
        ("ring", "full"),
        ("ring", "selective"),
        ("allgather", "op_selective"),
        ("ring", "op_selective"),
    ],
)
def test_cp_bytes_with_recompute_match_theory(pool, kind, recompute):
    """Recompute re-runs the forward exchange in backward where the re-run holds it: full recompute
    (the block) and op_selective (every op but the kept ones) for both kinds, selective (the attention
    core) for the ring only."""
    check_cp_bytes(pool, 2, 1, kind, recompute)


def check_cp_bytes(pool, cp, tp, kind, recompute):
    from megaframe.parallel.context import cp_bytes_per_layer
    from tests.distributed.cases import comm_volume

    L, S, B, kv, E, f32 = 2, 32, 2, 4, 8, 4  # cases.TINY: 2 layers, 4 kv heads of 64/8
    micro = 8 // B
    block = S // cp * B * kv // tp * E * f32  # this rank's K (or V) for one micro-batch
    fwd = 2 * (cp - 1) * block
    per = 2 * fwd if kind == "allgather" else 2 * fwd + 2 * cp * block
    if recompute in ("full", "op_selective") or (kind == "ring" and recompute == "selective"):
        per += fwd
    assert cp_bytes_per_layer(S, cp, B, kv // tp, E, f32, kind == "ring", recompute) == per
    over = [
        f"parallel.cp={cp}",
        f"parallel.tp={tp}",
        f"parallel.cp_comm={kind}",
        f"train.recompute={recompute}",
    ]
    sent = pool.run(comm_volume, cp * tp, over, tp=tp, cp=cp)[0]
    assert sent["cp"] == L * micro * per, (sent, L * micro * per)


L4 = "model.num_layers=4"
# (name, pp, overrides): pipeline stages carry this cp rank's S/c activations; recompute re-runs the K/V
# all-gather in backward (full) or keeps it and re-runs only the attention core (selective)
COMBOS = [
    ("cp2-pp2", 2, []),
    ("cp2-pp2-vpp2", 2, ["parallel.vpp=2", L4]),
    ("ring-cp2-pp2", 2, ["parallel.cp_comm=ring"]),
    ("ring-cp2-pp2-vpp2", 2, ["parallel.vpp=2", L4, "parallel.cp_comm=ring"]),
    ("ring-cp2-recompute-full", 1, ["train.recompute=full", "parallel.cp_comm=ring"]),
    ("cp2-recompute-full", 1, ["train.recompute=full"]),
    ("cp2-recompute-selective", 1, ["train.recompute=selective"]),
]


@pytest.mark.parametrize("name,pp,extra", COMBOS, ids=[c[0] for c in COMBOS])
def test_cp_combinations_match_one_process(pool, name, pp, extra):
    model = tuple(o for o in extra if o.startswith("model."))
    ref = reference(pool, model)
    got = pool.run(
        train_and_report, 2 * pp, ["parallel.cp=2", f"parallel.pp={pp}", *extra], STEPS, pp=pp, cp=2
    )[0]
    check(got, ref)


def test_cp_compiled_blocks_match_one_process(pool):
    """Compiled blocks with the cp all-gather left eager between the compiled pieces (comm.py)."""
    ref = reference(pool, ("model.num_layers=1",))
    got = pool.run(
        train_and_report, 2, ["model.num_layers=1", "parallel.cp=2", "train.compile=true"], 2, cp=2
    )[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"][:2])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_close_dicts(got["grads"], ref["grads"], rtol=1e-4, atol=1e-5, what="grad")


# first: (cp, HSDP shard group size (0: none), zero) on cp·dp2 ranks (one rank at cp1); then: (cp, tp, zero)
@pytest.mark.parametrize(
    "first,then",
    [
        ((2, 0, "optim.zero=1"), (1, 1, "optim.zero=1")),
        ((1, 0, "optim.zero=0"), (2, 2, "optim.zero=1")),
        ((2, 0, "optim.zero=3"), (1, 1, "optim.zero=1")),
        ((2, 2, "optim.zero=2"), (1, 1, "optim.zero=0")),
    ],
    ids=[
        "cp2-dp2-zero1-to-cp1",
        "cp1-to-cp2-tp2-sp-zero1",
        "cp2-dp2-zero3-to-cp1",
        "cp2-dp2-hsdp2-zero2-to-cp1",
    ],
)
def test_checkpoint_resumes_across_cp(pool, tmp_path, first, then):
    """Checkpoints are layout-free under cp (parameters and their placements do not change): 2 steps in
    one layout, saved, one more in another give the uninterrupted one-process losses and weights (that step's
    loss reads the loaded weights, its update the loaded moments and the schedule's place)."""
    from tests.distributed.zero_cases import run_steps

    ref = pool.run(run_steps, 1, ["optim.zero=0"], 3)[0]
    (cp1, shard, z1), (cp2, tp2, z2) = first, then
    n1 = 4 if cp1 == 2 else 1  # cp2·dp2 on four ranks
    hsdp = [f"optim.shard_group_size={shard}"] if shard else []
    pool.run(
        run_steps, n1, [f"parallel.cp={cp1}", z1, *hsdp], 3, None, str(tmp_path), 0, 2, cp=cp1, shard=shard
    )
    over = [f"parallel.cp={cp2}", f"parallel.tp={tp2}", f"parallel.sp={str(tp2 > 1).lower()}", z2]
    got = pool.run(
        run_steps, cp2 * tp2, over, 3, str(tmp_path / "step_00000002"), None, 2, 3, tp=tp2, cp=cp2
    )[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"][2:])]
    assert max(rel) <= 1e-5, (got["losses"], ref["losses"])
    assert_weights_close(got["weights"], ref["weights"])


RING = [
    (2, 1, 1, False, 0, ()),
    (4, 1, 1, False, 0, ()),
    (2, 2, 1, True, 0, ()),
    (2, 1, 2, False, 1, ()),
    (2, 1, 1, False, 0, tuple(GPT2)),
]


@pytest.mark.parametrize(
    "cp,tp,dp,sp,zero,family",
    RING,
    ids=["ring-cp2", "ring-cp4", "ring-cp2-tp2-sp", "ring-cp2-dp2-zero1", "ring-gpt2-cp2"],
)
def test_ring_matches_one_process(pool, cp, tp, dp, sp, zero, family):
    """cp_comm=ring: K/V blocks around the ring, partial results merged by log-sum-exp."""
    ref = reference(pool, family)
    over = list(family) + [
        f"parallel.cp={cp}",
        f"parallel.tp={tp}",
        f"parallel.sp={str(sp).lower()}",
        f"optim.zero={zero}",
        "parallel.cp_comm=ring",
    ]
    got = pool.run(train_and_report, cp * tp * dp, over, STEPS, tp=tp, cp=cp)[0]
    check(got, ref)


# (name, cp, dp, HSDP shard group size (0: all cp·dp ranks), overrides): ZeRO-2/3 shard over cp·dp, their
# reduce-scatters (and zero=3's gathers) run over it; HSDP cuts cp·dp into shard groups of s and replicas
ZERO_CP = [
    ("cp2-dp2-zero2", 2, 2, 0, ["optim.zero=2", "optim.bucket_size_mb=0.01"]),
    ("cp2-dp2-zero3", 2, 2, 0, ["optim.zero=3"]),
    (
        "ring-cp2-dp2-zero3-keep",
        2,
        2,
        0,
        ["optim.zero=3", "parallel.cp_comm=ring", "optim.reshard_after_forward=false"],
    ),
    ("cp2-dp2-hsdp2-zero2", 2, 2, 2, ["optim.zero=2", "optim.bucket_size_mb=0.01"]),
    ("ring-cp2-dp2-hsdp2-zero3", 2, 2, 2, ["optim.zero=3", "parallel.cp_comm=ring"]),
    ("cp4-hsdp2-zero1", 4, 1, 2, ["optim.zero=1", "optim.bucket_size_mb=0.01"]),
]


@pytest.mark.parametrize("name,cp,dp,shard,extra", ZERO_CP, ids=[c[0] for c in ZERO_CP])
def test_zero_and_hsdp_under_cp_match_one_process(pool, name, cp, dp, shard, extra):
    """Equal to one process, with grads, state and params sharded 1/s over the cp·dp ranks (s the shard
    group, cp·dp without HSDP) and the dp bytes of zero=3 to the byte (test_zero3's theory, its dp
    being the shard group)."""
    from tests.distributed.optim.test_zero3 import theory_dp_bytes
    from tests.distributed.zero_cases import run_steps

    ref = reference(pool, ())
    over = [f"parallel.cp={cp}", *extra] + ([f"optim.shard_group_size={shard}"] if shard else [])
    got = pool.run(run_steps, cp * dp, over, STEPS, cp=cp, shard=shard)[0]
    check(got, ref)
    s = shard or cp * dp
    m, b = got["mem"], got["buffer_numel"]
    assert m["mem/optim_bytes"] == 8 * b // s  # the two fp32 Adam moments of the owned range
    if "optim.zero=1" in extra:
        assert m["mem/grads_bytes"] == 4 * b
        return
    if "optim.zero=2" in extra:
        assert m["mem/grads_bytes"] == 4 * b // s
        return
    assert m["mem/params_bytes"] == 4 * b // s  # every param sharded, none kept whole
    keep = "optim.reshard_after_forward=false" in extra
    assert got["comm"][-1]["dp"] == theory_dp_bytes(
        got["bucket_numels"], got["bucket_uses"], s, cp * dp // s, got["microbatches"], not keep
    )


def test_zero3_under_cp_and_pp_matches_one_process(pool):
    """ZeRO-3 on cp2·pp2 (dp = 1: its shard axis is the cp group itself), ring attention, blocks kept
    gathered from first forward to last backward (the pipeline setting)."""
    from tests.distributed.zero_cases import run_steps

    over = [
        "parallel.cp=2",
        "parallel.pp=2",
        "optim.zero=3",
        "optim.reshard_after_forward=false",
        "parallel.cp_comm=ring",
    ]
    check(pool.run(run_steps, 4, over, STEPS, pp=2, cp=2)[0], reference(pool, ()))


DROPOUT = ["model.dropout=0.1"]
# (name, cp, tp, overrides): under tp the heads' masks come from tp_distinct's stream, under recompute
# the ring re-runs with the restored generator and must draw the same mask again (and its backward once
# more, from the state saved at that draw)
RING_DROPOUT = [
    ("cp2", 2, 1, []),
    ("cp4", 4, 1, []),
    ("cp2-tp2-sp", 2, 2, ["parallel.sp=true"]),
    ("cp2-recompute-selective", 2, 1, ["train.recompute=selective"]),
    ("cp2-recompute-full", 2, 1, ["train.recompute=full"]),
]


@pytest.mark.parametrize("name,cp,tp,extra", RING_DROPOUT, ids=[c[0] for c in RING_DROPOUT])
def test_ring_dropout_matches_allgather(pool, name, cp, tp, extra):
    """Attention dropout in the ring draws the all-gather path's masks (one [B, H, Q, T] draw, block
    columns by source rank): the same losses, grads and weights with dropout on, and different ones from a
    run without dropout (the masks bite)."""
    over = DROPOUT + [f"parallel.cp={cp}", f"parallel.tp={tp}", *extra]
    # the bite is measured on the losses, which drift apart past 1e-3 by step 6 (8e-4 by step 3): the case
    # that measures it runs 6 steps, the others STEPS
    steps = 6 if name == "cp2" else STEPS
    gathered = pool.run(train_and_report, cp * tp, over, steps, None, True, tp=tp, cp=cp)[0]
    ring = pool.run(
        train_and_report, cp * tp, over + ["parallel.cp_comm=ring"], steps, None, True, tp=tp, cp=cp
    )[0]
    check(ring, gathered)
    if name == "cp2":
        plain = pool.run(
            train_and_report, cp, [f"parallel.cp={cp}", "parallel.cp_comm=ring"], steps, None, True, cp=cp
        )[0]
        assert max(abs(a - b) / b for a, b in zip(plain["losses"], ring["losses"])) > 1e-3


def small_ring_tiles(model):
    """Ring tiles of 64 score elements: 2 heads x 16 rows x ... every block crosses tile boundaries."""
    for block in model.layers.values():
        block.attn.ring_tile_elems = 64


def ring_without_overlap(model):
    for block in model.layers.values():
        block.attn.ring_overlap = False


@pytest.mark.parametrize("setup", [small_ring_tiles, ring_without_overlap], ids=["tiled", "no-overlap"])
def test_ring_tiles_and_overlap_switch_match_one_process(pool, setup):
    """The ring's query-row tiles (bounded working memory) and its bench-only no-overlap order give the
    one-process numbers too."""
    ref = reference(pool, ())
    got = pool.run(train_and_report, 4, ["parallel.cp=4", "parallel.cp_comm=ring"], STEPS, setup, cp=4)[0]
    check(got, ref)


@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_cp_bf16_tracks_one_process_bf16(pool, kind):
    """bf16 params (ZeRO-1's fp32 master and grads) under cp: finite, and within bf16 rounding of the
    one-process bf16 run (the layouts round partial sums in different places: 3e-5, not fp32 noise)."""
    from tests.distributed.zero_cases import bf16_losses

    over = ["optim.zero=1", "optim.bucket_size_mb=0.01"]
    ref = pool.run(bf16_losses, 1, over, STEPS)[0]
    got = pool.run(bf16_losses, 2, over + ["parallel.cp=2", f"parallel.cp_comm={kind}"], STEPS, cp=2)[0]
    assert got["finite"] and got["param_dtype"] == "torch.bfloat16", got
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    assert rel <= 3e-4, (got["losses"], ref["losses"])  # measured 3e-5; a step moves the loss ~4e-3
