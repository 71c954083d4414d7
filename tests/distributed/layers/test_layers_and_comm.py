"""Parallel layers against dense torch, and the byte counters against the ring-algorithm volumes."""

import pytest

from tests.distributed.cases import comm_volume, vocab_layers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_vocab_parallel_embedding_and_cross_entropy(pool, tp, sp):
    errs = pool.run(vocab_layers, tp, sp, tp=tp)[0]
    assert errs["loss"] < 1e-5 and errs["grad"] < 1e-5, errs


@pytest.mark.parametrize(
    "tp,dp,sp", [(2, 1, False), (2, 1, True), (4, 1, False), (2, 2, False), (1, 2, False)]
)
def test_comm_bytes_match_theory(pool, tp, dp, sp):
    """Tiny model (L=2, D=64, S=32, micro-batch 2, 8 samples/step, vocab 256, 8 heads / 4 groups, F=128).

    Per micro-batch on tp: 4L+2 activation all-reduces of S*B*D floats (fwd: embedding, attn out and mlp
    out per block; bwd: qkv input, mlp input per block, head input), sent 2(n-1)/n each; under sp the same
    traffic as all-gather + reduce-scatter pairs ((n-1)/n each, twice as many), plus, in backward, the
    re-gather of each column-parallel input (qkv, up_proj per block, the head: 2L+1), whose forward
    gather is not kept for backward (Megatron's sp activation saving). Cross-entropy: a max and a
    [2, S, B] sum. Per step: the grad-norm scalar; under sp the partial grads of replicated params.
    dp: one all-reduce of all grads (flat) plus nothing else inside the step.
    """
    L, D, S, B, F, V = 2, 64, 32, 2, 128, 256
    micro = 8 // (B * dp)
    over = [f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"]
    sent = pool.run(comm_volume, tp * dp, over, tp=tp)[0]
    n, f32 = tp, 4
    ring = 2 * (n - 1) / n
    per_micro = (4 * L + 2) * ring * S * B * D * f32 + ring * 3 * S * B * f32
    tp_bytes = micro * per_micro + ring * f32  # + grad-norm scalar
    if sp:
        replicated = (2 * L + 1) * D  # RMSNorm weights (gpt_tiny has no biases)
        tp_bytes += ring * replicated * f32
        tp_bytes += micro * (2 * L + 1) * (n - 1) / n * S * B * D * f32  # backward re-gathers
    # each collective's count is truncated to an int separately; allow that rounding
    assert abs(sent.get("tp", 0) - tp_bytes) <= 64, (sent, tp_bytes)
    if dp > 1:
        params = (V * D + L * (D * (64 + 2 * 32) + 64 * D + D * 2 * F + F * D + 2 * D) + D + V * D) // tp
        if tp > 1:  # replicated norm weights are whole on every tp rank
            params += (2 * L + 1) * D - (2 * L + 1) * D // tp
        assert abs(sent["dp"] - 2 * (dp - 1) / dp * params * f32) <= 64, (sent, params)
