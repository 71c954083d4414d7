"""The planner's memory per phase (start-up, first step, save, load: planning/phases.py) against the peaks the
trainer's meter measures on the gloo pool (training/phases.py), each within 10 %.

The planner models start-up on the meta device, ZeRO-3 sharding every parameter and a resume read into the
shards through one staging buffer (issue 24, items 1-4), which the code now does: start-up and load meet
it at every layout but one. Where the planner's model still misses the measurement (ZeRO-3's first step and
save: the gathered units in flight are more than it counts; the dp4 load's staging) the assertion is
xfail(strict) with the reason: it turns into a failure the day the model is right, so the mark is then
removed, never the bound loosened.

The step phase under ZeRO-1 on gloo sometimes also holds gloo's own staging copy of the param all-gather
(made on gloo's thread, freed when its work completes: whether it falls inside the phase is timing), so its
upper bound adds the rank's param bytes; NCCL gathers in place."""
import pytest

from megaframe.planning.estimate import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.phase_cases import measure_phases

pytestmark = pytest.mark.distributed

MODEL = ["train.device=cpu", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.vocab_size=2048", "model.seq_length=64",
         "model.num_layers=2"]
TOL = 0.10
NEEDS = "the planner's model of ZeRO-3's gathered units in flight (step, save) and of the dp4 load misses"
# (name, ranks, tp, pp, overrides, phases today's code is known to miss)
# today: a resume reads into full local-shape tensors (load); ZeRO-3 start-up copies and clones the whole local
# params, leaves the blocks gathered until the first forward (step) and a save gathers every block (save)
LAYOUTS = [
    ("zero1-dp2", 2, 1, 1, ["optim.zero=1"], set()),
    ("zero3-dp2", 2, 1, 1, ["optim.zero=3"], {"step", "save"}),
    ("zero3-dp4", 4, 1, 1, ["optim.zero=3"], {"step", "save", "load"}),
]


_MEASURED: dict[str, list] = {}


def run_case(pool, tmp_path_factory, name, n, tp, pp, extra):
    """[(measured, planned) per rank]; each layout measured once for its four phases."""
    if name not in _MEASURED:
        overrides = MODEL + extra
        measured = pool.run(measure_phases, n, overrides, str(tmp_path_factory.mktemp(name)), tp=tp, pp=pp)
        plan = {(r.pp_rank, r.tp_rank): r for r in plan_layout(tiny_config(overrides, n), n).ranks}
        _MEASURED[name] = [(got, {**plan[(got["pp_rank"], got["tp_rank"])].phases,
                                  "gloo_staging": plan[(got["pp_rank"], got["tp_rank"])].params_bytes})
                           for got in measured]
        for got in measured:  # the table of the note: measured, planned (new behaviour), and today's model
            r = plan[(got["pp_rank"], got["tp_rank"])]
            print(f"\n{name} pp{got['pp_rank']}: " + ", ".join(
                f"{k} {got[k] / 2**20:.2f}/{r.phases[k] / 2**20:.2f} MiB ({got[k] / r.phases[k]:.3f})" for k in r.phases)
                + f"; today's model: startup {r.today_startup_bytes / 2**20:.2f}, load {r.today_load_bytes / 2**20:.2f}")
    return _MEASURED[name]


@pytest.mark.parametrize("phase", ["startup", "step", "save", "load"])
@pytest.mark.parametrize("name,n,tp,pp,extra,misses", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_phase_peak_matches_planner(pool, tmp_path_factory, request, name, n, tp, pp, extra, misses, phase):
    rows = run_case(pool, tmp_path_factory, name, n, tp, pp, extra)
    if phase in misses:
        request.applymarker(pytest.mark.xfail(reason=NEEDS, strict=True))
    report = [f"{name} {phase} rank {i}: measured {got[phase]} planned {want[phase]} "
              f"ratio {got[phase] / want[phase]:.3f}" for i, (got, want) in enumerate(rows)]
    print("\n" + "\n".join(report))
    for (got, want), line in zip(rows, report):
        slack = want["gloo_staging"] if phase == "step" and "optim.zero=1" in extra else 0
        assert -TOL * want[phase] <= got[phase] - want[phase] <= TOL * want[phase] + slack, line
