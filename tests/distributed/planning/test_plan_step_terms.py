"""The step phase's named terms (memory.phases.step_terms) that the default layouts of test_plan_phases.py
leave at zero, held to the trainer's measured step peak on the gloo pool within the same 10 % (plus the same
allowance for gloo's worker-thread copies): ZeRO-3 with optim.reshard_after_forward=false (every block
kept gathered from its forward to its backward, not the running and the prefetched one), and the
whole-logits loss (train.fused_head_loss=false: the logits, their fp32 copy and the fp32 log-softmax at
once). Four blocks, so keeping all of them gathered is two blocks more than resharding holds, and a wide
vocabulary, so the logits outweigh one block's activations: each term moves the plan past the band if it
were left out."""

import pytest

from megaframe.planning.memory.rank_plan import plan_layout
from tests.distributed.cases import tiny_config
from tests.distributed.phase_cases import measure_phases
from tests.distributed.step_term_cases import gathered_high

pytestmark = pytest.mark.distributed

MODEL = ["train.device=cpu", "model.num_layers=4"]
TOL = 0.10
CASES = [
    (
        "zero3-dp2-no-reshard",
        [
            "optim.zero=3",
            "optim.reshard_after_forward=false",
            "model.hidden_size=256",
            "model.ffn_hidden_size=512",
            "model.vocab_size=2048",
            "model.seq_length=64",
        ],
        "zero3 gathered: running + prefetched blocks",
    ),
    (
        "zero1-dp2-whole-logits",
        [
            "optim.zero=1",
            "train.fused_head_loss=false",
            "model.hidden_size=128",
            "model.ffn_hidden_size=256",
            "model.vocab_size=8192",
            "model.seq_length=256",
        ],
        "logits/loss transient",
    ),
]


@pytest.mark.parametrize("name,extra,term", CASES, ids=[c[0] for c in CASES])
def test_step_term_holds_the_measured_step(pool, tmp_path, name, extra, term):
    overrides = MODEL + extra
    measured = pool.run(measure_phases, 2, overrides, str(tmp_path))
    ranks = {(r.pp_rank, r.tp_rank): r for r in plan_layout(tiny_config(overrides, 2), 2).ranks}
    for got in measured:
        r = ranks[(got["pp_rank"], got["tp_rank"])]
        want, terms = r.phases["step"], r.step_terms
        line = f"{name}: measured {got['step']} planned {want} ({got['step'] / want:.3f}); " + ", ".join(
            f"{k} {v}" for k, v in terms.items()
        )
        print("\n" + line)
        assert sum(terms.values()) == want and terms.get(term, 0) > 0, line
        # gloo's worker-thread copies of the collectives may still be held (test_plan_phases.py's allowance)
        upper = (1 + TOL) * want + r.params_bytes + r.grads_bytes
        assert (1 - TOL) * want <= got["step"] <= upper, line
        # without the term the plan falls below the measured band: the term is what holds it
        assert got["step"] > (1 + TOL) * (want - terms[term]), line


def test_without_reshard_every_block_stays_gathered(pool):
    """ZeRO-3's own count of the param bytes gathered at once (Zero3Optimizer.gathered_high): with
    optim.reshard_after_forward=false it reaches every block of the rank (the plan's kept-gathered
    term), where resharding holds less than that (the running and the prefetched block and the ends)."""
    dims = [
        "model.hidden_size=256",
        "model.ffn_hidden_size=512",
        "model.vocab_size=2048",
        "model.seq_length=64",
    ]
    base = MODEL + dims + ["optim.zero=3"]
    kept = pool.run(gathered_high, 2, base + ["optim.reshard_after_forward=false"])
    resharded = pool.run(gathered_high, 2, base)
    r = plan_layout(tiny_config(base + ["optim.reshard_after_forward=false"], 2), 2).ranks[0]
    blocks = r.step_terms["zero3 gathered: running + prefetched blocks"]
    assert all(k >= blocks for k in kept), (kept, blocks)
    assert all(x < blocks for x in resharded), (resharded, blocks)
