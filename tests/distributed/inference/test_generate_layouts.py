"""A checkpoint saved under tp2·pp2 generates, greedily, the same tokens as the one-process run's; so does
the training-time sampler run under tp2·pp2·sp itself."""

import pytest
import torch

import megaframe
from megaframe.inference.decode import generate
from megaframe.inference.sampling import SamplingConfig
from tests.distributed.generate_cases import train_and_save

pytestmark = pytest.mark.distributed


def test_tp2_pp2_checkpoint_generates_like_one_process(pool, tmp_path):
    over = ["model.num_layers=4", "parallel.sp=true"]
    prompt = [7, 99, 3, 21]
    one, _ = pool.run(train_and_save, 1, over, 3, str(tmp_path / "one"), prompt)[0]
    results = pool.run(
        train_and_save,
        4,
        over + ["parallel.tp=2", "parallel.pp=2"],
        3,
        str(tmp_path / "tp2pp2"),
        prompt,
        tp=2,
        pp=2,
    )
    four, in_layout = results[0]
    a, b = megaframe.load_model(one), megaframe.load_model(four)
    ids_BS = torch.arange(3, 27).view(1, -1)
    with torch.no_grad():
        assert (a(ids_BS) - b(ids_BS)).abs().max().item() < 1e-4
    greedy = SamplingConfig(temperature=0)
    ga = generate(a, prompt, 24, greedy, 256)
    gb = generate(b, prompt, 24, greedy, 256)
    assert len(ga.tokens) == 24 and ga.tokens == gb.tokens
    assert all(r[1] == ga.tokens[:12] for r in results)  # every rank agrees on the sampler's tokens
