"""The one loop that runs a rank's schedule (any kind, any pp and vpp; pp = 1 included).

Legend: S sequence (S/tp under sp), B micro-batch, D hidden.
Stage boundaries carry x_SBD activations forward and their grads backward. The output of a forward
is kept as the root of its backward; its storage is released right after its send is issued (the
autograd graph does not need the output's values, and the in-flight send holds the storage until it
completes: Megatron's deallocate trick), so a rank holds only the activations the schedule's warm-up
requires. Consecutive communication actions are one batch (`p2p.start`), as the schedule groups them;
a batch is waited for right before the first compute that reads one of its receives, so receives the
schedule posts early (to meet the peer's sends, schedule.py) do not hold this rank's compute back.

Zero-bubble kinds (a schedule with W actions): B computes the chunk's input gradient only and W, later,
its weight gradients (pipeline/split.py); the weights' grads become final at the last W of each chunk,
so that is where ZeRO's reduce-scatters launch (`backward_context(is_last=True)`). Under zbv's V the
last rank's chunk 0 feeds its own chunk 1: the output becomes the next chunk's input (a fresh leaf, so
each chunk keeps its own graph) and that leaf's gradient the first chunk's output gradient, in memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd import Variable

from megaframe.parallel import comm, lanes
from megaframe.parallel.mesh import Mesh
from megaframe.parallel.observe import action_range
from megaframe.pipeline import p2p, split
from megaframe.pipeline.overlap import Pairs
from megaframe.pipeline.schedule import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    locate,
    stage_of,
)


@dataclass
class _State:
    inputs: dict = field(default_factory=dict)  # (mb, chunk) -> received activation (leaf)
    outputs: dict = field(default_factory=dict)  # (mb, chunk) -> backward root: activation or scaled loss
    grads: dict = field(default_factory=dict)  # (mb, chunk) -> received grad of the output
    to_send: dict = field(default_factory=dict)  # (SEND_F | SEND_B, mb, chunk) -> tensor
    arriving: dict = field(default_factory=dict)  # (RECV_F | RECV_B, mb, chunk) -> its batch's Transfer
    in_flight: list = field(default_factory=list)  # every Transfer of the schedule, all waited at the end
    pending_w: dict = field(default_factory=dict)  # (mb, chunk) -> split.PendingW, from its B to its W
    loss_sum: torch.Tensor | None = None


def run_schedule(
    actions: list[Action],
    model,
    batches,
    mesh: Mesh,
    optimizer,
    tokens_global: int,
    timeline: list | None = None,
    paired: frozenset[int] | None = None,
) -> torch.Tensor:
    """Run every action; returns the sum of token losses of this rank's micro-batches (0 off the last stage).

    With `timeline`, appends (action, start, end) in perf_counter seconds for each compute action. `paired`
    (an overlapped kind's schedule.paired_forwards, else None): the forwards, by position in the compute
    order, run beside the backward after them (pipeline/overlap.py). A
    forward-only schedule (grouping.forward_schedule: evaluation, under no_grad) keeps no backward roots.
    """
    # A device scalar, summed without .item(): the loss is read on the host only at log steps.
    st = _State(loss_sum=torch.zeros((), device=batches[0][0].device))
    # The last backward (W when split) of each chunk is where its grads become final: ZeRO launches
    # reduce-scatters there.
    splits = any(a.kind == W for a in actions)
    last_b = {a.chunk: i for i, a in enumerate(actions) if a.kind == (W if splits else "B")}
    params = [p for p in model.parameters() if p.requires_grad] if splits else None
    # Receive buffers are sized from the config, not from a message: p2p carries no shape header, so
    # sender and receiver must agree on it (the same micro-batch shape on every rank).
    shape = _activation_shape(model, batches[0][0])
    dtype = next(model.parameters()).dtype
    step = _Step(st, model, batches, mesh, optimizer, tokens_global, splits, last_b, params)
    step.pairs = Pairs(paired, batches[0][0].device) if paired is not None else None
    try:
        _run_actions(actions, step, shape, dtype, timeline)
    finally:
        if step.pairs is not None:
            step.pairs.close()
    for transfer in st.in_flight:  # the sends must have left before the step's optimizer and the next step
        transfer.wait()
    assert not (st.inputs or st.outputs or st.grads or st.to_send or st.arriving or st.pending_w), (
        "schedule left work undone"
    )
    return st.loss_sum


@dataclass
class _Step:
    """What every compute action of one run_schedule reads."""

    st: _State
    model: object
    batches: list
    mesh: Mesh
    optimizer: object
    tokens_global: int
    splits: bool
    last_b: dict
    params: list | None
    pairs: Pairs | None = None

    def compute(self, a: Action, i: int) -> Callable[[], None]:
        """Action a (at i in the action list), to run here or on the pair's worker."""

        def run() -> None:
            # a profiler range per action while a step is profiled (train.profile_steps), else a shared null
            with action_range(self.mesh.stats, a.kind, a.microbatch, a.chunk, self.splits):
                if a.kind == F:
                    # a split chunk's saved tensors boxed: B releases those W will not read (split.py)
                    with split.saving() if self.splits else contextlib.nullcontext():
                        _forward(a, self.st, self.model, self.batches, self.tokens_global, self.pairs)
                else:
                    with self.optimizer.backward_context(is_last=i == self.last_b.get(a.chunk)):
                        _backward(a, self.st, self.model, self.params)

        return run

    def single(self, a: Action, i: int, timeline: list | None) -> None:
        """An action run alone (under an overlapped kind, on its micro-batch's lane)."""
        _await(a, self.st)
        t0 = time.perf_counter()
        if self.pairs is None:
            self.compute(a, i)()
        else:
            with lanes.use(self.pairs.alone(a.kind == F, (a.microbatch, a.chunk))):
                self.compute(a, i)()
        if timeline is not None:
            timeline.append((a, t0, time.perf_counter()))


def _run_actions(actions: list[Action], step: _Step, shape, dtype, timeline: list | None) -> None:
    """run_schedule's loop: each batch of transfers, then the compute after it (a pair at once)."""
    comm: list[Action] = []
    device, pairs = step.batches[0][0].device, step.pairs
    n, skip = -1, False  # n: the position in the compute order
    for i, a in enumerate(actions):
        if a.kind not in COMPUTE:
            comm.append(a)
            continue
        # Issued before the compute: the schedule placed this batch to meet the peer's, and delaying it
        # behind our compute would stall the peer's matching batch (NCCL sends rendezvous).
        _communicate(comm, step.st, step.mesh, shape, dtype, device)
        comm, n = [], n + 1
        if skip:  # the backward of the pair just run
            skip = False
        elif pairs is not None and n in pairs.paired:
            b = actions[i + 1]
            _run_pair(a, b, step.st, pairs, step.compute(a, i), step.compute(b, i + 1), timeline)
            skip = True
        else:
            step.single(a, i, timeline)
    _communicate(comm, step.st, step.mesh, shape, dtype, device)


def _await(a: Action, st: _State) -> None:
    transfer = st.arriving.pop((RECV_F if a.kind == F else RECV_B, a.microbatch, a.chunk), None)
    if transfer is not None:  # the compute reads this batch's receive
        transfer.wait()


def _run_pair(f: Action, b: Action, st: _State, pairs: Pairs, run_f, run_b, timeline) -> None:
    """An overlapped kind's forward and the backward after it (another micro-batch's), at once."""
    # adjacent in the action list: the timetable runs the pair in one tick (grouping._replay_unit_times)
    assert b.kind == B and b.microbatch != f.microbatch, (f, b)
    _await(f, st)
    _await(b, st)
    f_span, b_span = pairs.run(run_f, run_b, (f.microbatch, f.chunk), (b.microbatch, b.chunk))
    if timeline is not None:
        timeline += [(f, *f_span), (b, *b_span)]


def reduce_loss(loss_sum: torch.Tensor, model, mesh: Mesh) -> torch.Tensor:
    """run_schedule's loss sums over cp·dp, whole on the logging rank (the last pipeline rank). Under zbv's
    V the loss chunk is rank 0's (it holds both ends), so the sum also runs over pp (0 on the other ranks)."""
    total = comm.all_reduce(loss_sum, mesh.dpcp)
    return comm.all_reduce(total, mesh.pp) if model.stage.v else total


def _activation_shape(model, input_ids_BS: torch.Tensor) -> tuple[int, int, int]:
    b, s = input_ids_BS.shape
    tp = model.mesh.tp.size
    return (s // tp if model.sp else s, b, model.cfg.hidden_size)


def _is_loss_chunk(model, chunk: int) -> bool:
    return model.stage.last and chunk == len(model.stage.chunks) - 1


def _neighbour_chunk(model, chunk: int, step: int) -> int | None:
    """This rank's chunk holding the stage `step` (+1 or -1) away from `chunk`'s, or None when that stage
    is another rank's (or there is none): only zbv's turn, where the last rank holds stages pp-1 and pp."""
    pp, v = model.mesh.pp.size, model.stage.v
    s = stage_of(model.mesh.pp.rank, chunk, pp, v) + step
    if not 0 <= s < pp * len(model.stage.chunks):
        return None
    rank, c = locate(s, pp, v)
    return c if rank == model.mesh.pp.rank else None


def _forward(a: Action, st: _State, model, batches, tokens_global: int, pairs: Pairs | None = None) -> None:
    key = (a.microbatch, a.chunk)
    input_ids_BS, labels_BS = batches[a.microbatch]
    x_SBD = st.inputs.pop(key, None)
    # the loss's grad per token is 1 / tokens_global (below), known now: the fused head folds it in forward
    scale = 1.0 / tokens_global if torch.is_grad_enabled() and _is_loss_chunk(model, a.chunk) else None
    out = model.forward_chunk(a.chunk, x_SBD, input_ids_BS, labels_BS, loss_scale=scale)
    if pairs is not None:  # its backward runs on its lane, on whichever thread autograd runs it
        out = lanes.mark(out, pairs.lane[key])
    if not torch.is_grad_enabled():  # forward-only (evaluation): nothing to keep for a backward
        if _is_loss_chunk(model, a.chunk):
            st.loss_sum += out.float().sum()
        else:
            _hand_on(a, st, model, out)
        return
    if _is_loss_chunk(model, a.chunk):
        # fp32 sum of per-token losses: a bf16 sum over B·S tokens would round away the small terms.
        total = out.float().sum()
        st.loss_sum += total.detach()
        # Divided by the global token count, not this micro-batch's: every reduction of the grads is then
        # a plain sum, whatever the layout (layout invariance).
        st.outputs[key] = (total / tokens_global, x_SBD)
    else:
        st.outputs[key] = (out, x_SBD)
        _hand_on(a, st, model, out)


def _hand_on(a: Action, st: _State, model, out: torch.Tensor) -> None:
    """The output goes to the next stage: a message, or at zbv's turn this rank's chunk 1."""
    nxt = _neighbour_chunk(model, a.chunk, +1)
    if nxt is None:
        st.to_send[(SEND_F, a.microbatch, a.chunk)] = out
    else:  # a leaf of its own (under no_grad one without grad), so each chunk keeps its own graph
        st.inputs[(a.microbatch, nxt)] = out.detach().requires_grad_(torch.is_grad_enabled())


def _backward(a: Action, st: _State, model, params) -> None:
    key = (a.microbatch, a.chunk)
    if a.kind == W:
        split.backward_weight(st.pending_w.pop(key))
        return
    root, x_SBD = st.outputs.pop(key)
    grad = st.grads.pop(key, None)
    if params is not None:  # zero-bubble: B is the input gradient only; W comes later
        gx, st.pending_w[key] = split.backward_input(root, grad, x_SBD, params)
        _hand_back(a, st, model, gx)
    elif grad is None:
        root.backward()
    else:
        # the root's storage may be released already: run the engine directly, skipping the shape
        # check torch.autograd.backward would do against it
        Variable._execution_engine.run_backward((root,), (grad,), False, False, (), True, True)
    if params is None and x_SBD is not None:
        _hand_back(a, st, model, x_SBD.grad)


def _hand_back(a: Action, st: _State, model, gx) -> None:
    """The input's gradient goes to the previous stage: a message, or at zbv's turn this rank's chunk 0."""
    if gx is None:
        return
    prv = _neighbour_chunk(model, a.chunk, -1)
    if prv is None:
        st.to_send[(SEND_B, a.microbatch, a.chunk)] = gx
    else:
        st.grads[(a.microbatch, prv)] = gx


def _communicate(comm: list[Action], st: _State, mesh: Mesh, shape, dtype, device) -> None:
    """One batched exchange for consecutive communication actions."""
    if not comm:
        return
    sends, releases, recvs, arrivals = [], [], [], []
    for a in comm:
        key = (a.microbatch, a.chunk)
        if a.kind in (SEND_F, SEND_B):
            t = st.to_send.pop((a.kind, *key))
            # Detached: the send must not hold the graph; contiguous: p2p sends raw storage.
            sends.append((t.detach().contiguous(), a.peer))
            if a.kind == SEND_F and t.grad_fn is not None:
                releases.append(t)
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
            recvs.append((buf, a.peer))
            arrivals.append((a.kind, key, buf))
    transfer = p2p.start(mesh.pp, sends, recvs)
    st.in_flight.append(transfer)
    for out in releases:  # the send holds the storage (the detached view above) until it completes
        out.data = torch.empty((0,), dtype=out.dtype, device=out.device)
    for kind, key, buf in arrivals:
        st.arriving[(kind, *key)] = transfer
        if kind == RECV_F:
            # A leaf requiring grad: its .grad after the chunk's backward is what SEND_B returns upstream.
            st.inputs[key] = buf.requires_grad_()
        else:
            assert kind == RECV_B
            st.grads[key] = buf
