"""ZeRO-3 with compiled blocks (torchtitan's default for 8B): the per-block gathers and frees run in the
blocks' hooks around the compiled forward, and two steps give the eager run's losses and grads to float noise.
The hooks stay out of the graph: one graph for the block, no graph break, no recompile (dynamo's counters;
before, the traced hooks made 7 graphs for 2 layers and broke at every collective, wait and resize).
"""

import pytest

from tests.distributed.model.test_model_equivalence import assert_close_dicts, assert_weights_close
from tests.distributed.zero_cases import run_steps, run_steps_counting_graphs

pytestmark = pytest.mark.distributed

ONE_LAYER = ["optim.zero=3", "model.num_layers=1"]


def test_zero3_compiled_blocks_equal_eager(pool):
    eager = pool.run(run_steps, 2, ONE_LAYER, 2)[0]
    compiled = pool.run(run_steps_counting_graphs, 2, ONE_LAYER + ["train.compile=true"], 2)[0]
    assert (compiled["graphs"], compiled["breaks"], compiled["recompiles"]) == (1, {}, {}), compiled
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert_close_dicts(compiled["grads"], eager["grads"], rtol=1e-4, atol=1e-6, what="grad")
    assert_weights_close(compiled["weights"], eager["weights"])
