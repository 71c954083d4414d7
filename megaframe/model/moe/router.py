"""The MoE router: an fp32 linear gate, top-k selection, and the router's losses.

Legend: T tokens of this rank's micro-batch (S/tp·B under sp, else S·B), D hidden, E experts (all of
them: the router is replicated over tp and ep), K = moe_top_k.

Scores: softmax over the experts, or an independent sigmoid per expert (DeepSeek-V3). The top-k
weights are the chosen scores renormalised to sum 1. With the aux-loss-free expert bias, the bias is
added to the scores for *selection only*; the weights use the unbiased scores.

Losses (both layout-invariant: statistics are over the whole micro-batch, see MoE.forward):
    aux (Switch/GShard)  E · sum_e f_e · P_e,  f_e = count_e / (T·K) (fraction of assignments),
                         P_e = mean over tokens of the normalised scores; 1 when perfectly balanced
    z-loss               mean over tokens of logsumexp(logits)^2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.layers.shard import Shard, sharded_param
from megaframe.parallel.placement import Placement
from megaframe.pipeline.split import wanted


@dataclass
class Routing:
    experts_TK: torch.Tensor
    """Chosen experts per token (int64), in decreasing order of (biased) score."""
    weights_TK: torch.Tensor
    """fp32 combine weights (renormalised scores of the chosen experts); carries the router's grad."""
    probs_TE: torch.Tensor
    """fp32 score distribution over experts (sums to 1 per token): aux loss and entropy."""


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    score: str = "softmax",
    bias_E: torch.Tensor | None = None,
    groups: tuple[int, int] = (1, 1),
    norm: bool = True,
    scale: float = 1.0,
    forced_TK: torch.Tensor | None = None,
) -> Routing:
    """Top-k routing of fp32 logits (pure function; the reference the tests check by hand). DeepSeek-V3's
    options: `groups` (n_group, topk_group) limits a token to its topk_group best expert groups (a group's
    score: the sum of its two best selection scores), `norm` false keeps the chosen scores as they are,
    `scale` multiplies the combine weights (routed_scaling_factor). `forced_TK`: the experts chosen
    already (model.moe_force_balance: `balanced_experts`), weighted by their scores as top-k's would be."""
    # fp32: in bf16 many scores round to ties, and top-k choices would flip on rounding noise.
    logits_TE = logits_TE.float()
    if score == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
        probs_TE = scores_TE
    else:
        scores_TE = torch.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
    if forced_TK is not None:
        experts_TK = forced_TK
    else:
        select_TE = scores_TE.detach() if bias_E is None else scores_TE.detach() + bias_E.float()
        if groups[0] > 1:
            select_TE = _group_limited(select_TE, *groups)
        # topk on the detached scores: selection is not differentiable; ties go to the lower expert index
        experts_TK = torch.topk(select_TE, top_k, dim=-1, sorted=True).indices
    chosen_TK = scores_TE.gather(-1, experts_TK)
    # clamp: sigmoid scores can all underflow to 0 for a token; 0/0 would turn its output into NaN.
    weights_TK = chosen_TK / chosen_TK.sum(-1, keepdim=True).clamp_min(1e-20) if norm else chosen_TK
    return Routing(experts_TK, weights_TK * scale if scale != 1.0 else weights_TK, probs_TE)


def balanced_experts(positions_T: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """experts_TK of model.moe_force_balance: the token at sequence position p goes to (p + j·s) mod E for
    j < K, s = E // K. Any E consecutive positions give every expert exactly K assignments, so a rank's
    tokens (a run per sp block, two per cp chunk pair) load the experts alike to K rows per run; and a
    token's K experts lie s apart, spread over the ep ranks and nodes as a trained router's are (each on
    its own rank once ep >= K), not K neighbours on one rank, so the ep all-to-all carries what a real run's
    would (under parallel.ep_dispatch=node too). From the position alone: every layout routes a token
    the same way."""
    j_K = torch.arange(top_k, device=positions_T.device) * (num_experts // top_k)
    return (positions_T[:, None] + j_K) % num_experts


def _group_limited(select_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """The selection scores with every expert outside a token's topk_group best groups at -inf (a group's
    score: its two best experts' summed, as DeepSeek-V3 and transformers' DeepseekV3TopkRouter rank them)."""
    t, e = select_TE.shape
    group_TG = select_TE.view(t, n_group, e // n_group).topk(min(2, e // n_group), dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
    keep_TG.scatter_(1, torch.topk(group_TG, topk_group, dim=-1).indices, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    return select_TE.masked_fill(~keep_TE, float("-inf"))


def load_balancing_loss(
    probs_TE: torch.Tensor, counts_E: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """E · sum_e (counts_e / (N·K)) · (sum_t probs_te / N) over a micro-batch of N tokens.

    counts_E are the whole micro-batch's assignment counts (constants); probs_TE may be only this rank's
    tokens of it (sequence parallel): the result is then this rank's additive share of the loss and its
    gradient is exact for these tokens."""
    e = probs_TE.shape[-1]
    return e * (probs_TE.sum(0) * counts_E.to(probs_TE.dtype)).sum() / (num_tokens * num_tokens * top_k)


def sequence_counts(experts_TK: torch.Tensor, batch: int, num_experts: int) -> torch.Tensor:
    """[B, E] assignments of each sequence (tokens are sequence-major: token t is sequence t % B)."""
    seq_T = torch.arange(experts_TK.shape[0], device=experts_TK.device) % batch
    flat_A = (seq_T[:, None] * num_experts + experts_TK).reshape(-1)
    counts = flat_A.new_zeros(batch * num_experts).scatter_add_(0, flat_A, torch.ones_like(flat_A))
    return counts.view(batch, num_experts)


def sequence_balancing_loss(
    probs_TE: torch.Tensor, counts_BE: torch.Tensor, seq: int, top_k: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, its alpha left out: per sequence b of `seq` tokens,
    sum_e f_be · P_be with f_be = E · count_be / (K · seq) and P_be the mean over its tokens of the normalised
    scores, averaged over the B sequences. counts_BE are whole sequences' (constants); probs_TE may be only
    this rank's tokens of them (sp, cp): the result is then this rank's additive share."""
    b, e = counts_BE.shape
    seq_T = torch.arange(probs_TE.shape[0], device=probs_TE.device) % b
    p_BE = probs_TE.new_zeros(b, e).index_add(0, seq_T, probs_TE) / seq
    f_BE = counts_BE.to(probs_TE.dtype) * e / (top_k * seq)
    return (f_BE * p_BE).sum() / b


def z_loss(logits_TE: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """sum_t logsumexp(logits_t)^2 / N: this rank's share of the micro-batch mean (N tokens in all)."""
    # logsumexp, not log(sum(exp)): large router logits (what z-loss penalises) would overflow exp().
    return torch.logsumexp(logits_TE.float(), dim=-1).square().sum() / num_tokens


def entropy_sum(probs_TE: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the routing distribution's entropy (nats); detached."""
    p = probs_TE.detach()
    # clamp inside the log only: p·log p -> 0 as p -> 0, and log(0) would give 0·(-inf) = NaN.
    return -(p * p.clamp_min(1e-20).log()).sum()


class Router(nn.Module):
    """logits_TE = x_TD @ W[E, D]^T in fp32. W is replicated over tp and ep, reduced over dp; under sp
    each tp rank routes its own sequence block, so W's grad is partial over tp (tp_partial_grad).
    `expert_bias` [E] is a buffer (saved in checkpoints, moved outside autograd by moe.stats)."""

    def __init__(self, hidden: int, num_experts: int, sp: bool, device=None, buffer_device=None):
        super().__init__()
        self.weight = sharded_param(Shard((num_experts, hidden)), device, tp_partial_grad=sp, role="router")
        # buffer_device: the run's device when the weight
        # starts on meta (build_model materialises params only)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=buffer_device or device))
        self.state_placements = {"expert_bias": Placement(Shard((num_experts,)))}

    def _apply(self, fn, recurse=True):
        """model.to(bf16) casts buffers too: keep the bias fp32, its small steps would round away."""
        super()._apply(fn, recurse)
        if self.expert_bias.is_floating_point() and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        # fp32 gate even in a bf16 model: expert choice is a discrete decision sensitive to rounding.
        if x_TD.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.linear(x_TD, self.weight)
        return _Fp32Gate.apply(x_TD, self.weight)


class _Fp32Gate(torch.autograd.Function):
    """logits_TE = float(x_TD) @ float(w_ED)^T, as F.linear on the fp32 casts computes it, forward and
    backward, but saving x and w as they came (bf16) and casting them again in backward (as Megatron's router
    gating does): autograd would keep the fp32 copy of x, twice x's bytes, a [T, D] fp32 tensor a layer a
    micro-batch (64 MiB at Qwen3-30B-A3B's 8192 tokens). The casts are exact, so the grads are the same."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        return F.linear(x_TD.float(), w_ED.float())

    @staticmethod
    def backward(ctx, g_TE):
        x_TD, w_ED = ctx.saved_tensors
        # a split backward (zero-bubble) asks for grad x (B) and grad w (W) in two passes
        whole = torch.compiler.is_compiling()
        gx = gw = None
        if ctx.needs_input_grad[0] and (whole or wanted(x_TD)):
            gx = (g_TE @ w_ED.float()).to(x_TD.dtype)
        if ctx.needs_input_grad[1] and (whole or wanted(w_ED)):
            gw = (g_TE.t() @ x_TD.float()).to(w_ED.dtype)
        return gx, gw
