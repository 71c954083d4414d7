"""The MoE block MLP: router, capacity, dispatch over ep, stacked SwiGLU experts, and the router losses.

Legend: S sequence (S/cp, then /tp under sp), B batch, D hidden, T = S·B tokens on this rank, N tokens of
the whole micro-batch (T·cp, ·tp under sp), E experts, L = E/ep local experts, F expert width, K top-k,
J runs of consecutive positions among a rank's tokens, G ranks splitting one micro-batch's sequence.

Sharding: experts are stacked [E, ...] tensors split along dim 0 over ep (Shard axis "ep"). MoE under tp
needs sp, so every rank of a stage routes its own tokens. With ep = etp = 1 the experts are replicated
over tp like the router, their grads partial over tp (tp_partial_grad) and summed before the step; with
ep·etp > 1 they are folded over tp·cp·dp (parallel/rank_grid.py): the ep group may hold tp peers, the
tp ranks holding the same experts are edp peers, and the grads are summed over edp alone.

Context parallelism: each cp rank routes the tokens it holds (its two chunks of every sequence), as a
tp rank does its block under sp. The router losses' statistics are the micro-batch's: the routed counts
are gathered over the ranks splitting its sequence (tp under sp, and cp) and N counts all their tokens,
so each rank's aux/z term is its additive share of the one-process loss, exact in value and gradient
(the counts are constants of the loss; the scores it differentiates are this rank's own tokens), and
the shares add up in the objective through each rank's own backward, as dp ranks' micro-batches do.
Router and experts are replicated over cp, so their grads are partial over it: the router's reduced
over cp·dp with the dense params, the experts' over edp, which ep cuts out of cp·dp (parallel/mesh.py).

Router losses reach the objective without touching the pipeline executor (Megatron's trick): the
output passes through `_InjectLoss`, the identity forward, which in backward also seeds the losses'
graph with d(objective)/d(loss) = N / tokens_per_step, the micro-batch's share of the step's tokens.
The LM loss is a token sum over tokens_per_step, so the objective is loss + mean router losses
over the global batch, in every layout. The logged `aux_loss`/`z_loss` are those mean terms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.config.schema import ModelConfig
from megaframe.layers.shard import Shard, sharded_param
from megaframe.model.moe import dispatcher, grouped, node_dispatch, router
from megaframe.parallel import comm, context
from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Mesh

# The dispatch runs eagerly inside a compiled block (train.compile): its row counts follow the routing and
# its collectives note bytes and times on the host, so dynamo, guarding on them, recompiled its frames
# every micro-batch until it hit its recompile limit (8 per frame); its host sync breaks the graph anyway.
_eager_dispatch = eager(dispatcher.dispatch_combine)
_eager_by_node = eager(node_dispatch.dispatch_combine_by_node)

STAT_NAMES = ("dropped", "assigned", "entropy_sum", "tokens", "aux", "z")
"""Per-step scalars each MoE layer accumulates after its E per-expert routed counts (see moe.stats)."""


class _InjectLoss(torch.autograd.Function):
    """forward: identity on y; backward: y's grad unchanged, and `scale` as the grad of `loss`."""

    @staticmethod
    def forward(ctx, y, loss, scale: float):
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device)
        if torch.compiler.is_compiling():
            # a new tensor, not a view: AOT autograd rebuilds an output that aliases an input outside the
            # graph, and the router losses' seed was lost (compiled router grads 30-90 % off eager's)
            return y.clone()
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        dtype, device = ctx.loss_meta
        # A constant seed, not derived from g: the router losses' weight in the objective does not depend
        # on what flows back through y, and a device scalar from a Python float needs no host sync.
        return g, torch.full((), ctx.scale, dtype=dtype, device=device), None


class _Stacked(nn.Module):
    """Holds one stacked expert weight, so its global name reads `...experts.up_proj.weight`."""

    def __init__(
        self, shard: Shard, device, tp_partial_grad: bool, rows: tuple[int, ...] = (), folded: bool = False
    ):
        super().__init__()
        self.weight = sharded_param(
            shard, device, tp_partial_grad=tp_partial_grad, expert_rows=rows, expert_folded=folded
        )


class Experts(nn.Module):
    """L SwiGLU experts: up_proj.weight [L, 2F, D] (fused [gate | up]), down_proj.weight [L, D, F]."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, sp: bool, device=None):
        super().__init__()
        e, d, f, ep, etp = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn, mesh.ep, mesh.etp
        folded = mesh.experts_folded
        # folded experts are no tp copies: their tp peers' grads are summed over edp, not as tp partials
        partial = sp and not folded
        # under etp each expert is split as a column-parallel gate/up (gate and up blocks apart, so the
        # local [gate_i | up_i] pair up) and a row-parallel down projection
        up_in = Shard((e, 2 * f, d), 1, (f, f), etp.rank, etp.size, "etp") if etp.size > 1 else None
        down_in = Shard((e, d, f), 2, (), etp.rank, etp.size, "etp") if etp.size > 1 else None
        up = Shard((e, 2 * f, d), 0, (e,), ep.rank, ep.size, "ep", up_in)
        self.up_proj = _Stacked(up, device, partial, (f, f), folded)
        down = Shard((e, d, f), 0, (e,), ep.rank, ep.size, "ep", down_in)
        self.down_proj = _Stacked(down, device, partial, (), folded)

    def forward(
        self,
        x_ND: torch.Tensor,
        sizes: list[int],
        ends_L: torch.Tensor | None = None,
        w_N1: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows grouped by local expert (sizes[l] rows for expert l; ends_L their cumulative sums on the
        device), all experts in one grouped GEMM per projection (moe/grouped.py), each row's output
        weighted by w_N1 when given. Every expert's weight takes part, even with no rows, so each gets a
        (zero) grad like in one process."""
        up, down = self.up_proj.weight, self.down_proj.weight
        return grouped.swiglu_experts(x_ND, up, down, sizes, ends_L, w_N1)

    def forward_loop(
        self, x_ND: torch.Tensor, sizes: list[int], w_N1: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The per-expert loop the grouped GEMM replaced: the reference its tests and bench compare to."""
        outs = []
        w_rows = [None] * len(sizes) if w_N1 is None else w_N1.split(sizes)
        for w_up, w_down, rows_ND, w_M1 in zip(
            self.up_proj.weight.unbind(0), self.down_proj.weight.unbind(0), x_ND.split(sizes), w_rows
        ):
            outs.append(F.linear(grouped.weighted_swiglu(F.linear(rows_ND, w_up), w_M1), w_down))
        return torch.cat(outs)


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts, experts split over mesh.ep. See the module docstring."""

    def __init__(
        self, cfg: ModelConfig, mesh: Mesh, sp: bool, device=None, tokens_per_step: int | None = None
    ):
        super().__init__()
        self.cfg, self.tp, self.ep, self.cp, self.sp = cfg, mesh.tp, mesh.ep, mesh.cp, sp
        self.etp = mesh.etp
        # parallel.ep_dispatch=node with the ep group over several nodes (moe/node_dispatch.py); None: one
        # all-to-all (inside one node the two are the same exchange)
        across = mesh.ep_rail is not None and mesh.ep_rail.size > 1
        self.by_node = (mesh.ep_rail, mesh.ep_node) if across else None
        # its rows skip the capacity cut and the etp gathers: refused by the config, held here as well
        assert not across or (cfg.moe_capacity_factor is None and mesh.etp.size == 1), "dispatch by node"
        self.tokens_per_step = tokens_per_step
        self._ahead: dict[int, torch.Tensor] = {}  # _batch_counts' run order masks, by sequence length
        self._forced: dict[tuple, torch.Tensor] = {}  # _forced_experts' choices, by (rows, batch, device)
        self.router = router.Router(cfg.hidden_size, cfg.num_experts, sp, device, mesh.device)
        self.experts = Experts(cfg, mesh, sp, device)
        # this step's statistics, accumulated over micro-batches on the device (no host sync)
        # (a plain attribute, not a buffer: model.to(bf16) must not cast it)
        # on the mesh's device even when the params start on meta (build_model): not a parameter
        self.step_stats = torch.zeros(
            cfg.num_experts + len(STAT_NAMES), dtype=torch.float64, device=mesh.device
        )

    def _batch_counts(self, experts_TK: torch.Tensor, counts_E: torch.Tensor, batch: int):
        """(routed counts of the whole micro-batch, plan's `runs` for capacity or None). The micro-batch's
        sequence is split over cp (two chunks per rank) and, under sp, each rank's rows over tp; every rank
        routes its own tokens, so the counts of the group's runs (context.cp_runs) are gathered: their sum
        is the micro-batch's, and the runs ahead of each of ours give what they took of the capacity."""
        blocks = self.tp.size if self.sp else 1
        if blocks * self.cp.size == 1:
            return counts_E, None
        rows = experts_TK.shape[0] // batch  # tokens are sequence-major: row s holds tokens s·B .. s·B+B-1
        seq, runs, me = self._sequence_runs(rows)
        e = self.cfg.num_experts
        run_JE = torch.stack(
            [dispatcher.expert_counts(experts_TK[lo * batch : hi * batch].reshape(-1), e) for lo, hi, _ in me]
        )
        # Gathered, not all-reduced: besides the total, capacity needs the counts of the runs before ours to
        # drop the same assignments as one process would. Order (cp rank, tp rank), as `runs` lists them.
        all_GJE = run_JE.unsqueeze(0)
        if blocks > 1:
            all_GJE = comm.all_gather_dim0(all_GJE, self.tp)
        all_GJE = comm.all_gather_dim0(all_GJE, self.cp)
        if seq not in self._ahead:  # static per sequence length: built once, not a host copy per layer call
            start_G = [g for rank_runs in runs for _, _, g in rank_runs]
            self._ahead[seq] = torch.tensor(
                [[s < g for s in start_G] for _, _, g in me], device=counts_E.device
            )
        # the runs of the whole group that come before each of ours in the micro-batch's token order
        before_JE = (self._ahead[seq][:, :, None] * all_GJE.reshape(-1, e)[None]).sum(1)
        return all_GJE.sum((0, 1)), (run_JE, before_JE)

    def _sequence_runs(self, rows: int) -> tuple[int, list, list]:
        """(sequence length, the runs of every rank splitting a micro-batch's sequence in (cp rank, tp rank)
        order, this rank's runs) for `rows` rows a rank (context.cp_runs: cp chunks, sp blocks over tp)."""
        blocks = self.tp.size if self.sp else 1
        seq = rows * blocks * self.cp.size
        runs = [
            context.cp_runs(seq, self.cp.size, r, blocks, t)
            for r in range(self.cp.size)
            for t in range(blocks)
        ]
        return seq, runs, runs[self.cp.rank * blocks + (self.tp.rank if blocks > 1 else 0)]

    def _forced_experts(self, rows: int, batch: int, device: torch.device) -> torch.Tensor:
        """model.moe_force_balance's experts_TK for this rank's tokens (router.balanced_experts): each row's
        global sequence position from the runs the rank holds (its cp chunks, its sp block), repeated over
        the batch (tokens are sequence-major). A constant of the layout: built once."""
        key = (rows, batch, device)
        if key not in self._forced:
            me = self._sequence_runs(rows)[2]
            pos_S = torch.cat([torch.arange(g, g + hi - lo, device=device) for lo, hi, g in me])
            c = self.cfg
            self._forced[key] = router.balanced_experts(
                pos_S.repeat_interleave(batch), c.moe_top_k, c.num_experts
            )
        return self._forced[key]

    def forward(self, x_SBD: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        s, b, d = x_SBD.shape
        x_TD = x_SBD.reshape(-1, d)
        # the micro-batch's tokens: this rank's, times the sp blocks and cp ranks that split its sequence
        n = x_TD.shape[0] * (self.tp.size if self.sp else 1) * self.cp.size
        logits_TE = self.router(x_TD)
        bias_E = self.router.expert_bias if c.moe_expert_bias else None
        groups = (c.moe_n_group, c.moe_topk_group)
        r = router.route(
            logits_TE,
            c.moe_top_k,
            c.moe_router_score,
            bias_E,
            groups,
            c.moe_norm_topk_prob,
            c.moe_routed_scaling_factor,
            self._forced_experts(s, b, x_TD.device) if c.moe_force_balance else None,
        )
        counts_E = dispatcher.expert_counts(r.experts_TK.reshape(-1), c.num_experts)
        batch_E, runs = self._batch_counts(r.experts_TK, counts_E, b)
        y_TD, dropped = self._dispatch(x_TD, r, counts_E, runs, n)
        # Skipped under no_grad (eval): no backward to inject into, and eval batches stay out of step_stats.
        if torch.is_grad_enabled():
            y_TD = self._add_losses(y_TD, r, logits_TE, batch_E, counts_E, dropped, n, b)
        return y_TD.view(s, b, d)

    def _dispatch(self, x_TD, r: router.Routing, counts_E, runs, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_TD: each token's weighted expert outputs, the assignments dropped by the capacity limit)."""
        c = self.cfg
        if self.by_node is not None and not x_TD.is_meta:  # dropless only (parallel/layout_rules.py)
            rail, node = self.by_node
            y_TD = _eager_by_node(x_TD, r.experts_TK, r.weights_TK, c.num_experts, rail, node, self.experts)
            return y_TD, torch.zeros((), dtype=torch.int64, device=x_TD.device)
        capacity = None
        if c.moe_capacity_factor is not None:
            # From n, the whole micro-batch's tokens
            # (not this rank's block): the same capacity in every layout.
            capacity = math.ceil(c.moe_capacity_factor * n * c.moe_top_k / c.num_experts)
        plan = dispatcher.plan(
            r.experts_TK, r.weights_TK, c.num_experts, capacity, counts_E=counts_E, runs=runs
        )
        # the planner (megaframe.plan) runs this forward on meta tensors: shapes only, no values to sync on,
        # so its route assumes perfectly balanced routing (and the plain dispatch: dispatch by node keeps
        # what it does, the experts' input rows); every saved tensor is the trainer's own
        route = dispatcher.balanced_route(plan, self.ep, self.etp, capacity) if x_TD.is_meta else None
        return _eager_dispatch(x_TD, plan, self.ep, self.experts, self.etp, route), plan.dropped

    def _sequence_loss(self, r: router.Routing, n: int, batch: int) -> torch.Tensor:
        """The sequence-wise balance loss (router.sequence_balancing_loss) of this micro-batch's sequences,
        their counts summed over the ranks that split them (tp under sp, and cp)."""
        counts_BE = router.sequence_counts(r.experts_TK, batch, self.cfg.num_experts)
        if self.sp:
            counts_BE = comm.all_reduce(counts_BE, self.tp)
        counts_BE = comm.all_reduce(counts_BE, self.cp)
        return router.sequence_balancing_loss(r.probs_TE, counts_BE, n // batch, self.cfg.moe_top_k)

    def _add_losses(
        self, y_TD, r: router.Routing, logits_TE, batch_E, counts_E, dropped, n: int, batch: int = 1
    ) -> torch.Tensor:
        """Attach the router losses to y's backward and add this micro-batch to the step statistics."""
        c = self.cfg
        # The micro-batch's share of the step's tokens: summed over micro-batches and dp ranks the router
        # losses enter the objective as a token-weighted mean, like the LM loss.
        share = n / (self.tokens_per_step or n)
        aux = c.moe_aux_loss_coeff * router.load_balancing_loss(r.probs_TE, batch_E, n, c.moe_top_k)
        if c.moe_seq_aux_loss_coeff > 0:
            aux = aux + c.moe_seq_aux_loss_coeff * self._sequence_loss(r, n, batch)
        z = c.moe_z_loss_coeff * router.z_loss(logits_TE, n) if c.moe_z_loss_coeff > 0 else aux.new_zeros(())
        if c.moe_aux_loss_coeff > 0 or c.moe_z_loss_coeff > 0 or c.moe_seq_aux_loss_coeff > 0:
            y_TD = _InjectLoss.apply(y_TD, aux + z, share)
        # Kept on the device in fp64 and read only by moe.stats at log steps: no host sync per micro-batch.
        with torch.no_grad():
            row = torch.stack(
                [
                    dropped.to(torch.float64),
                    counts_E.sum().to(torch.float64),
                    router.entropy_sum(r.probs_TE).to(torch.float64),
                    torch.full((), float(r.probs_TE.shape[0]), dtype=torch.float64, device=y_TD.device),
                    (aux.detach() * share).to(torch.float64),
                    (z.detach() * share).to(torch.float64),
                ]
            )
            self.step_stats += torch.cat([counts_E.to(torch.float64), row])
        return y_TD
