"""A layout's memory from the model's dims alone (no model built), for the search: the largest rank (first
or last pipeline stage), the peak over its phases (memory/phases.py: start-up, step, save, load). Parameters
counted from the dims per stage; grads and optimizer state as the ZeRO optimizer lays them out
(rank_state.state_bytes' rules without the bucket padding; ZeRO-2/3 grads and all ZeRO state over the shard
group, grads in the reduce dtype); activations per micro-batch from meta-device forwards at this tp / sp /
recompute (memory/activations.py: the bytes of a block, of the embedding and of the head + loss, on the
rank's S/cp tokens), times the micro-batch size, walked through the rank's own schedule (memory/inflight.py).
"""

from __future__ import annotations

from megaframe.config import Config
from megaframe.models.counts import matrix_params
from megaframe.optim.rule_registry import rule_named
from megaframe.planning.candidate import Layout, cp_ring, end_layers, layer_params, stage_layers, stage_params
from megaframe.planning.memory.block_memory import _CFGS, act_per_layer, working_set_bytes
from megaframe.planning.memory.block_memory import on_host as _on_host
from megaframe.planning.memory.inflight import peak_inflight
from megaframe.planning.memory.phases import RankShape, head_kind, phase_peaks

ZERO3_WHOLE_OUTSIDE_BLOCKS = False
"""ZeRO-3 keeps the params outside the blocks (embedding, head, final norm) whole, as optim/sizing.py counts
them today; False once ZeRO-3 shards every parameter."""


def memory(cfg: Config, lay: Layout) -> int:
    """Bytes the largest rank holds at its largest phase (first or last pipeline stage)."""
    return max(phase_memory(cfg, lay).values())


def phase_memory(cfg: Config, lay: Layout) -> dict[str, int]:
    """{phase: peak bytes} of the largest rank
    (the first or the last pipeline stage, whichever peaks higher)."""
    from megaframe.pipeline.schedule import resolve_kind

    m, t = cfg.model, cfg.train
    key = id(cfg)
    # a Config is not hashable for lru_cache: its id keys the
    # cache, and keeping it here stops the id being reused
    _CFGS[key] = cfg
    per_layer, embed, head = act_per_layer(key, lay.tp, lay.recompute, lay.cp)
    a_bytes = 4 if t.precision == "fp32" else 2  # fp8 runs keep bf16 params and activations (layers/fp8.py)
    micro = t.global_batch_size // (lay.micro_batch * lay.dp)
    kind = lay.schedule or resolve_kind(cfg.parallel.pp_schedule, lay.vpp)
    per_rank = stage_layers(m.num_layers, lay)
    worst: dict[str, int] = {}
    # the first stage holds the embedding, the last the head: the largest rank is one of them
    for rank in {0, lay.pp - 1}:
        first, last = rank == 0, rank == lay.pp - 1
        params, grads, optim = _state(cfg, lay, first, last, a_bytes)
        chunk_layers = per_rank[rank] // lay.vpp
        chunks = tuple(
            lay.micro_batch
            * (
                chunk_layers * per_layer
                + (embed if c == 0 and first else 0)
                + (head if c == lay.vpp - 1 and last else 0)
            )
            for c in range(lay.vpp)
        )
        act = peak_inflight(kind, lay.pp, lay.vpp, micro, rank, chunks) if lay.pp > 1 else chunks[0]
        act += working_set_bytes(cfg, lay.tp, lay.cp, lay.recompute, lay.micro_batch)
        peaks = phase_peaks(
            _shape(cfg, lay, first, last, a_bytes, lay.micro_batch * head),
            params,
            grads,
            optim,
            act + _cp_bias_bytes(cfg, lay, a_bytes),
            on_host=_on_host(cfg),
        )
        if max(peaks.values()) > max(worst.values(), default=-1):
            worst = peaks
    return worst


def _state(cfg: Config, lay: Layout, first: bool, last: bool, a_bytes: int) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of a stage's rank as the optimizer of lay.zero lays them out."""
    m = cfg.model
    dense, expert = stage_params(m, lay, first, last)
    n = dense + expert
    # the rule's bytes per element in optim.state_dtype by kind (Muon: other state on the hidden matrices)
    rule, dt = rule_named(cfg.optim.name), cfg.optim.state_dtype
    hid, other = (rule.bytes_per_element(dt, kind=k) for k in ("hidden", "other"))
    h_dense, h_expert = (end_layers(m, lay, first, last) * x for x in matrix_params(m, lay.tp, lay.ep))
    if not lay.zero:  # a grad per param in its dtype, the rule's state
        return a_bytes * n, a_bytes * n, hid * (h_dense + h_expert) + other * (n - h_dense - h_expert)
    # dense state is sharded over the shard group, expert state over the experts' (tp·cp·dp / ep ranks)
    s, es = lay.shard_size, lay.expert_shard_size(cfg.parallel.etp)
    owned, hidden = dense // s + expert // es, h_dense // s + h_expert // es
    state = hid * hidden + other * (owned - hidden)
    g = 2 if lay.grad_dtype == "bf16" else 4
    grads = g * (owned if lay.zero >= 2 else n)
    if lay.zero == 3:  # params: the fp32 owned range (the master), plus what stays whole; state: the rule's
        outside = n - end_layers(m, lay, first, last) * sum(layer_params(m, lay.tp, lay.ep))
        whole = a_bytes * outside if ZERO3_WHOLE_OUTSIDE_BLOCKS else 0
        return 4 * owned + whole, grads, state
    # a master: 4 more bytes per owned element of low-precision params
    return a_bytes * n, grads, state + (0 if cfg.train.precision == "fp32" else 4) * owned


def _shape(cfg: Config, lay: Layout, first: bool, last: bool, a_bytes: int, head_act: int = 0) -> RankShape:
    """memory.phases' view of a stage's rank, from the dims (rank_state.rank_shape counts a built model)."""
    m = cfg.model
    dense, expert = stage_params(m, lay, first, last)
    d, per = m.hidden_size, (2 if m.activation == "swiglu" else 1)
    mats = [d * (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim // lay.tp]
    mats.append(
        (m.num_experts // lay.ep) * per * m.expert_ffn * d
        if m.num_experts
        else per * m.ffn_hidden_size * d // lay.tp
    )
    block_mat = max(mats)
    table = m.vocab_size * d // lay.tp
    if first or last:
        mats.append(table)
    block_numel = sum(layer_params(m, lay.tp, lay.ep))
    logits = lay.micro_batch * m.seq_length // lay.cp * m.vocab_size // lay.tp if last else 0
    s = lay.shard_size or 1
    tied_across = m.tie_embeddings and lay.pp > 1
    # the largest owned segment a resume reads into
    # (rank_state._read_bytes): ZeRO-3's units are buckets of their own
    if lay.zero == 3:
        read = 4 * min(max(mats), max(block_numel, table) // s)
    elif lay.zero:
        read = max(a_bytes * max(mats), 4 * min(max(mats), int(cfg.optim.bucket_size_mb * 2**20) // 4 // s))
    else:
        read = 4 * max(mats)
    return RankShape(
        dense + expert,
        max(mats),
        a_bytes * block_numel,
        a_bytes,
        s,
        lay.dp * lay.cp,
        lay.zero,
        logits,
        a_bytes * block_numel * end_layers(m, lay, first, last),
        grad_elem=2 if lay.grad_dtype == "bf16" else 4,
        out_numel=(d + table) if last else 0,
        out_acc=not tied_across,
        block_param_numel=block_mat,
        head_act=head_act if last else 0,
        read_bytes=read,
        gloo=_on_host(cfg),
        head_kind=head_kind(lay.tp, cfg.train.fused_head_loss),
        reshard=cfg.optim.reshard_after_forward,
    )


def _cp_bias_bytes(cfg: Config, lay: Layout, a_bytes: int) -> int:
    """The [S/cp, S] causal bias the layers share under cp_comm=allgather with attention dropout
    (rank_state.cp_bias_bytes)."""
    if lay.cp == 1 or cp_ring(cfg) or not cfg.model.dropout > 0:
        return 0
    return cfg.model.seq_length**2 // lay.cp * a_bytes
