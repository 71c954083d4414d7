"""Memory traffic of the per-parameter passes (bf16 params, ZeRO-1 fp32 grads and master, one process),
counted op by op on CPU and held to a table in bytes per parameter element. These passes are memory-bound on a
GPU (about 1 ms per GB on an H100), so bytes are their time.

Per optimizer step (zero_grad + step), optim.step_kernel=eager: torch's fused AdamW reads and writes each
param's fp32 master and moments (8 + 8 + 8) and reads its grad (4); the norm reads the grad (4); the master
is cast to the bf16 params (4 + 2). Clipping is AdamW's grad_scale, whose only cost is the kernel writing
the clipped grad back (4), and zero_grad zeroes nothing (each grad's first write of the step overwrites).
Before that: zero_() 4 and a separate clip pass 8 on top, 50 in all. A step's transient copies count too.

optim.step_kernel=compiled (optim/adamw_fused.py): one pass per owned range reads the grad, the moments and
the master once and writes the moments, the master and the bf16 param once, the clip a scale inside it;
bf16-reduced grads are read as they are (no fp32 widening). Bytes per parameter, eager -> compiled
(STEP_TABLE; the norm's 4, or 2 from bf16 grads, is in each: the clip needs the whole norm before the pass):

    state   grads   eager                                            compiled
    fp32    fp32    42 (norm 4, AdamW 28 + grad back 4, cast 6)      34 (norm 4, pass 4+8+16+2)
    bf16    fp32    66 (+ moments widened 4+8, rounded back 8+4)     26 (norm 4, pass 4+8+8+2)
    fp32    bf16    48 (+ grads widened 2+4)                         30 (norm 2, pass 2+8+16+2)
    bf16    bf16    72                                               22 (norm 2, pass 2+8+8+2)

Muon's AdamW part (embeddings, head, norms): its pass 32 -> 30 per AdamW element, and the cast of its
ranges to bf16 (6) dropped; the hidden matrices' momentum and Newton-Schulz are Muon's own.

Per micro-batch (grads into the fp32 buffer): a linear's weight-grad GEMM writes its fp32 result into the
buffer in the step's first backward (4) and accumulates in the later ones (read 4, write 4); before, autograd
wrote a bf16 grad that a hook added into the buffer (write 2, read 2, read 4, write 4). The fused head + CE
is told the loss's upstream grad in forward (the executor's 1 / tokens per step), makes the logits' grad
scaled and sums dW straight into the buffer like a linear (4 / 8); before, it wrote an fp32 dW (4) that
backward scaled into the buffer (read 4, write 4, and read 4 more when accumulating): 12 / 16.
The norms keep the
hook: a bf16 grad is written (cast from fp32, read 4 more), read and copied into the buffer (2 + 4) or added
(2 + 8). An untied embedding adds only its looked-up rows into the buffer (read 4 + write 4 per token and
hidden element), after zeroing it in the step's first backward (4); before, a dense bf16 table grad went
through the hook as the norms' do (8 / 12 per element of the table). Under train.precision=fp8 the block
linears' weight grads take the same path as bf16's (before: a bf16 grad and the hook, 12 / 16).
"""

from __future__ import annotations

import pytest
import torch

from megaframe.layers.fp8 import Fp8Gemm
from megaframe.optim import adamw_fused
from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_data, build_model, microbatches, train_step
from tests.unit.optim.byte_count import ByteCount, storage_ptr

# tokens per micro-batch (24 x 2 = 48) and every dim differ, so no activation has a parameter's shape
SHAPES = ["train.precision=bf16", "model.seq_length=24", "model.ffn_hidden_size=96"]

STEP_BYTES = 42  # norm 4 + AdamW 28 + clipped grad written back 4 + master -> bf16 6 (zero_grad 0, clip 0)
STEP_PHASES = ("step", "adamw", "to_bf16")
# (optim.step_kernel, optim.state_dtype, optim.grad_reduce_dtype) -> bytes per parameter of a step
STEP_TABLE = {
    ("eager", "fp32", "fp32"): 42,
    ("eager", "bf16", "fp32"): 66,
    ("eager", "fp32", "bf16"): 48,
    ("eager", "bf16", "bf16"): 72,
    ("compiled", "fp32", "fp32"): 34,
    ("compiled", "bf16", "fp32"): 26,
    ("compiled", "fp32", "bf16"): 30,
    ("compiled", "bf16", "bf16"): 22,
}
# Muon's AdamW part: (its pass per AdamW element, the cast to bf16 of its ranges per AdamW element)
MUON_ADAMW = {"eager": (32, 6), "compiled": (28, 0)}
# bytes per element in the (first, each later) micro-batch of a step, by how the grad reaches the buffer
MICROBATCH_BYTES = {
    "linear": (4, 8),  # the weight-grad GEMM into the fp32 buffer
    "head": (4, 8),  # dW, scaled in forward (the executor's 1 / tokens), summed into the buffer by the GEMM
    "norm": (12, 16),  # fp32 grad cast to bf16 (6), then copied (6) / added (10) into the buffer
    "embed": (4, 0),  # the buffer zeroed once per step, + ROW_BYTES per looked-up row element
}
ROW_BYTES = 8  # an embedding row's grad added into the fp32 buffer: read 4, write 4 per element
# (the head's check that the promised upstream grad came reads and writes one element of the input grad,
# not of the buffer: layers/fused_ce.py)


def _kind(name: str) -> str:
    if name.startswith("embed"):
        return "embed"
    if name.startswith("head"):
        return "head"
    return "norm" if "norm" in name else "linear"


def _count(overrides: list[str], steps: int = 2):
    """Train `steps` steps; count the last one: (ByteCount, params by kind, micro-batches, tokens per one)."""
    cfg = tiny_config(SHAPES + overrides, 1)
    mesh = single_process_mesh()
    torch.manual_seed(0)
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    t = cfg.train
    data = build_data(cfg)
    batches = [
        microbatches(data, s, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed) for s in range(steps)
    ]
    for s in range(steps - 1):  # the first step makes the grads and moments
        train_step(model, opt, batches[s], mesh, cfg, s + 1)
    params = dict(model.named_parameters())
    shapes = {tuple(p.shape) for p in params.values()}
    grads = {storage_ptr(b.grad) for b in opt.buffers}
    weights = {storage_ptr(b.param) for b in opt.buffers}
    state = grads | weights | {storage_ptr(t) for st in opt.states for t in st.tensors()}
    # a step's transient copies of state or grads (bf16 state widened to fp32) count too; its scalars (norms,
    # clip divisor, step counts) are smaller than any parameter
    smallest = min(p.numel() for p in params.values())

    def tracked(x: torch.Tensor) -> bool:
        ptr = storage_ptr(x)
        if counter.phase in STEP_PHASES:
            return ptr in state or x.numel() >= smallest
        # a micro-batch: the grad buffer, and parameter-shaped grads on their way there (not the params)
        return ptr in grads or (tuple(x.shape) in shapes and ptr not in weights)

    counter = ByteCount(tracked)
    n_mb = [0]

    def phase(name, fn):
        def run(*a, **k):
            if name == "mb":
                n_mb[0] += 1
            counter.phase = f"mb{n_mb[0]}" if name == "mb" else name
            return fn(*a, **k)

        return run

    model.forward_chunk = phase("mb", model.forward_chunk)

    def within(name, fn):  # a phase inside the step's, back to it after
        def run(*a, **k):
            was, counter.phase = counter.phase, name
            try:
                return fn(*a, **k)
            finally:
                counter.phase = was

        return run

    if cfg.optim.name == "muon":  # Muon's AdamW part apart: its pass over the AdamW ranges, their cast
        opt.update.adam.step = within("adamw", opt.update.adam.step)
        opt._launch_param_gather = within("to_bf16", opt._launch_param_gather)
    opt.zero_grad = phase("zero_grad", opt.zero_grad)
    opt.step = phase("step", opt.step)
    cast = Fp8Gemm.cast

    def cast_apart(self, *a, **k):
        # float8 casts of weights are their own traffic (tests/unit/layers/test_fp8_casts.py counts them)
        was, counter.phase = counter.phase, "cast"
        try:
            return cast(self, *a, **k)
        finally:
            counter.phase = was

    Fp8Gemm.cast = cast_apart
    try:
        with counter:
            train_step(model, opt, batches[-1], mesh, cfg, steps)
    finally:
        Fp8Gemm.cast = cast
    return counter, params, n_mb[0], t.micro_batch_size * cfg.model.seq_length


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def counted(request):
    return _count([] if request.param == "bf16" else ["train.precision=fp8"])


def test_optimizer_step_bytes_per_parameter_follow_the_table(counted):
    counter, params, n_mb, _ = counted
    numel = sum(p.numel() for p in params.values())
    step = counter.per("zero_grad", numel) + counter.per("step", numel)
    assert step == STEP_BYTES, (step, counter.ops)


# each compiled case pays a compile on CPU (the dtypes differ): the two that meet the targets; the others
# in STEP_TABLE were counted the same way (fp32 grads compiled: 34 and 26)
STEP_CASES = [("eager", "bf16", "bf16"), ("compiled", "fp32", "bf16"), ("compiled", "bf16", "bf16")]


@pytest.mark.parametrize("kernel,state,grads", sorted(STEP_TABLE))
def test_the_planner_moves_the_counted_bytes_per_element(kernel, state, grads):
    """The planner's update time (planning/steptime/fixed.py) charges the bytes this file counts, for each
    kernel and dtype, eager (the default) included."""
    from megaframe.config import load_config
    from megaframe.planning.steptime.fixed import update_bytes_per_element

    over = [f"optim.step_kernel={kernel}", f"optim.state_dtype={state}", f"optim.grad_reduce_dtype={grads}"]
    cfg = load_config(["data=synthetic", "train.precision=bf16", *over])
    assert update_bytes_per_element(cfg, 2 if grads == "bf16" else 4) == STEP_TABLE[(kernel, state, grads)]


@pytest.mark.parametrize("kernel,state,grads", STEP_CASES)
def test_step_bytes_per_parameter_by_kernel_and_dtypes_follow_the_table(kernel, state, grads):
    """The eager step's other dtypes, and the compiled pass's (the compile on CPU: inductor's C++ loop)."""
    over = [f"optim.step_kernel={kernel}", f"optim.state_dtype={state}", f"optim.grad_reduce_dtype={grads}"]
    counter, params, _, _ = _count(over)
    numel = sum(p.numel() for p in params.values())
    step = counter.per("zero_grad", numel) + counter.per("step", numel)
    assert step == STEP_TABLE[(kernel, state, grads)], (step, counter.ops)
    # the counter takes the compiled op for one pass: it must have been one (test_adamw.py checks the loop)
    assert not adamw_fused._failed


@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_muon_adamw_part_bytes_per_element_follow_the_table(kernel):
    # bf16 grads: the compiled fp32-state case's pass (compiled once for both)
    over = ["optim.name=muon", f"optim.step_kernel={kernel}", "optim.grad_reduce_dtype=bf16"]
    counter, params, _, _ = _count(over)
    adamw = sum(p.numel() for p in params.values() if not p.placement.hidden_matrix)
    hidden = sum(p.numel() for p in params.values()) - adamw
    update, cast = MUON_ADAMW[kernel]
    assert counter.per("adamw", adamw) == update, counter.ops
    assert not adamw_fused._failed
    # the cast of the hidden matrices' ranges stays (6 per element); the AdamW ranges' only when eager
    assert counter.per("to_bf16", 1) == 6 * hidden + cast * adamw, counter.ops


def test_micro_batch_grad_bytes_per_parameter_follow_the_table(counted):
    counter, params, n_mb, tokens = counted
    numel = sum(p.numel() for p in params.values())
    assert n_mb == 4
    rows = sum(ROW_BYTES * tokens * p.shape[1] for n, p in params.items() if _kind(n) == "embed")
    for i, which in ((1, 0), (2, 1), (n_mb, 1)):
        want = sum(p.numel() * MICROBATCH_BYTES[_kind(n)][which] for n, p in params.items())
        want = (want + rows) / numel
        got = counter.per(f"mb{i}", numel)
        assert got == want, (i, got, want, {k: v for k, v in counter.ops.items() if k[0] == f"mb{i}"})


def test_fused_head_runs_one_chunk_at_4k_tokens_and_its_softmax_chain_writes_one_bf16_buffer():
    """The GPU path of layers/fused_ce.py: 4,096 tokens x a 128k vocab is one chunk (was 8 of 523: the 1 GB
    fp32 dW re-read and re-written per chunk), and the chunk's loss + softmax - onehot compile to one kernel
    whose only vocab-wide buffer is the bf16 grad (2 B per logit written, the bf16 logits read). The eager
    chain, which the GPU ran before and CPU runs still, moves 28 B per logit over fp32 copies (counted)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from megaframe.layers import fused_ce

    assert fused_ce._chunk_tokens(4096, 128256, torch.device("cuda")) == 4096
    c, v = 48, 1000
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(c, v, generator=gen).bfloat16(), torch.randint(0, v, (c,), generator=gen)
    counter = ByteCount(lambda x: x.dim() == 2 and x.shape[-1] == v)
    with counter:
        loss, grad = fused_ce._chain(logits, target)  # CPU: the eager chain
    assert abs(counter.per("", c * v) - 28) < 0.1, counter.ops  # + the picked elements
    torch._dynamo.reset()
    (loss_c, grad_c), code = run_and_get_code(torch.compile(fused_ce._ce_math, dynamic=False), logits, target)
    wide = re.findall(rf"empty_strided_cpu\(\({c}, {v}\), \([^)]*\), (torch\.\w+)\)", code[0])
    assert wide == ["torch.bfloat16"], wide  # the grad, and no fp32 copy of the logits
    assert len(set(re.findall(r"def (cpp_fused_\w+)|(cpp_fused_\w+)\(", code[0]))) >= 1
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_c, grad, rtol=0, atol=0.01)


def test_compiled_blocks_write_weight_grads_into_main_grad_as_eager_does():
    """train.compile keeps the weight-grad GEMM into main_grad (an opaque custom op in the compiled backward):
    every block linear takes it in every micro-batch, and the grads are eager's to bf16 noise."""
    from megaframe.layers import wgrad
    from tests.distributed.cases import train_and_report

    over = SHAPES + ["model.num_layers=1"]
    eager = train_and_report(single_process_mesh(), over, 1)
    before = wgrad.calls
    compiled = train_and_report(single_process_mesh(), over + ["train.compile=true"], 1)
    assert wgrad.calls - before == 4 * 4  # qkv, out_proj, up, down x 4 micro-batches
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    for name, g in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][name].float(), g.float(), rtol=0.05, atol=2e-4)
