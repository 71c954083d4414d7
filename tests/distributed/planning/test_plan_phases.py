"""The planner's memory per phase (start-up, first step, save, load: memory/phases.py) against the peaks the
trainer's meter measures on the gloo pool (training/phase_meter.py), each within 10 %, at ZeRO-1 (dp2,
pp2·dp2) and ZeRO-3 (dp2, dp4): what each phase holds is counted (ZeRO-3's gathered and prefetched blocks, its
grad buckets in flight and gloo's copies of the collectives at the last block's backward; the save's host copy
of the owned segments, nothing gathered; the load's one staging buffer of the largest range read into one
destination).

ZeRO-1's first step on gloo may also hold gloo's own copies of its collectives: each reduce-scatter clones its
grad bucket (made when launched in the last backward, freed when gloo's worker thread lets go of the finished
work) and each param all-gather after the update stages its whole output on that thread. Whether and how far
these overlap the backward's activations and each other is timing (measured up to 1.235 of the plan at
pp2·dp2), so its upper bound adds one copy of the rank's params and grads to the plan's 10 %; the lower bound
stays 10 %. ZeRO-3's step counts gloo's copies at the last block's backward, but a clone the worker thread has
not yet let go of may still be held then (measured 0.93-1.07 of the plan, once 1.105 at zero3-dp2 on an idle
machine): the same allowance. NCCL works in place (no such copies)."""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.phase_cases import measure_phases

pytestmark = pytest.mark.distributed

MODEL = [
    "train.device=cpu",
    "model.hidden_size=256",
    "model.ffn_hidden_size=512",
    "model.vocab_size=2048",
    "model.seq_length=64",
    "model.num_layers=2",
]
TOL = 0.10
# (name, ranks, tp, pp, overrides)
LAYOUTS = [
    ("zero1-dp2", 2, 1, 1, ["optim.zero=1"]),
    ("zero1-pp2-dp2", 4, 1, 2, ["optim.zero=1", "parallel.pp=2"]),
    ("zero3-dp2", 2, 1, 1, ["optim.zero=3"]),
    ("zero3-dp4", 4, 1, 1, ["optim.zero=3"]),
    ("zero3-tp2-dp2", 4, 2, 1, ["optim.zero=3", "parallel.tp=2"]),
]
ONE = ("zero0-one", 1, 1, 1, ["optim.zero=0"])
"""One process at zero=0, the reference of the share test. Not in the 10 % test: its first step makes the
moments after the activations are freed, the plan's step (every later one) holds both."""
SHARE = 0.35
"""Save and load at zero=3 dp4 against one process at zero=0 (a quarter is the share)."""


_MEASURED: dict[str, list] = {}


def run_case(pool, tmp_path_factory, name, n, tp, pp, extra):
    """[(measured, planned) per rank]; each layout measured once for its four phases."""
    if name not in _MEASURED:
        overrides = MODEL + extra
        measured = pool.run(measure_phases, n, overrides, str(tmp_path_factory.mktemp(name)), tp=tp, pp=pp)
        plan = {(r.pp_rank, r.tp_rank): r for r in plan_layout(tiny_config(overrides, n), n).ranks}
        _MEASURED[name] = [
            (
                got,
                {
                    **plan[(got["pp_rank"], got["tp_rank"])].phases,
                    "gloo_copies": gloo_copies(plan[(got["pp_rank"], got["tp_rank"])]),
                },
            )
            for got in measured
        ]
        for got in measured:  # the table of the note: measured, planned (new behaviour), and today's model
            r = plan[(got["pp_rank"], got["tp_rank"])]
            print(
                f"\n{name} pp{got['pp_rank']}: "
                + ", ".join(
                    f"{k} {got[k] / 2**20:.2f}/{r.phases[k] / 2**20:.2f} MiB ({got[k] / r.phases[k]:.3f})"
                    for k in r.phases
                )
                + f"; today's model: startup {r.today_startup_bytes / 2**20:.2f}, "
                f"load {r.today_load_bytes / 2**20:.2f}"
            )
    return _MEASURED[name]


def gloo_copies(r) -> int:
    """What gloo's copies of ZeRO-1's collectives may add to a step (module doc): the params and the grads
    once."""
    return r.params_bytes + r.grads_bytes


@pytest.mark.parametrize("phase", ["startup", "step", "save", "load"])
@pytest.mark.parametrize("name,n,tp,pp,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_phase_peak_matches_planner(pool, tmp_path_factory, name, n, tp, pp, extra, phase):
    rows = run_case(pool, tmp_path_factory, name, n, tp, pp, extra)
    report = [
        f"{name} {phase} rank {i}: measured {got[phase]} planned {want[phase]} "
        f"ratio {got[phase] / want[phase]:.3f}"
        for i, (got, want) in enumerate(rows)
    ]
    print("\n" + "\n".join(report))
    for (got, want), line in zip(rows, report):
        upper = (1 + TOL) * want[phase]
        if phase == "step":  # gloo's worker-thread copies (module doc), ZeRO-1 and ZeRO-3 alike
            upper += want["gloo_copies"]
        assert (1 - TOL) * want[phase] <= got[phase] <= upper, line


@pytest.mark.parametrize("phase", ["startup", "save", "load"])
def test_zero3_dp4_holds_its_share(pool, tmp_path_factory, phase):
    """Every rank of zero=3 dp4 peaks at <= 0.35 of one process at zero=0 in start-up, a save and a load. At
    start-up both hold their params only (ZeRO makes its grads and moments lazily, as torch's AdamW does)."""
    one = run_case(pool, tmp_path_factory, *ONE)[0][0][phase]
    for got, _ in run_case(pool, tmp_path_factory, *LAYOUTS[3]):
        assert got[phase] <= SHARE * one, (
            f"{phase}: zero3-dp4 {got[phase]} vs one process {one} ({got[phase] / one:.3f})"
        )
