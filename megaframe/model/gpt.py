"""The stage shell every family shares: the model, or one pipeline rank's part of it. It owns what lies
outside the blocks (the token embedding and learned positions, the RoPE tables and document context, the
pipeline chunks, the final norm, the head and the loss, ZeRO-3's gather units) and builds each block through
its family's builder (model/block.py: `BlockArgs`; the family names it in models/<family>/spec.py).

Legend: B batch, S sequence (S/tp between blocks under sp), D hidden, V vocab rows on this rank (V/tp).
Parameter names are global (`layers.{i}....` with the global layer index) so init and checkpoints do
not depend on the layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaframe.config.schema import ModelConfig
from megaframe.layers.fused_ce import linear_cross_entropy
from megaframe.layers.linear import ColumnParallelLinear
from megaframe.layers.norm import Norm
from megaframe.layers.rng import tp_distinct
from megaframe.layers.shard import InitSpec, Shard, init_model, sharded_param
from megaframe.layers.vocab import VocabParallelEmbedding, parallel_logits, vocab_parallel_cross_entropy
from megaframe.model import mtp
from megaframe.model.block import BlockArgs, build_block
from megaframe.model.documents import DocContext, document_context, rope_at
from megaframe.model.kv_cache import KVCache
from megaframe.model.recompute import op_selective_checkpoint
from megaframe.model.rope import rope_tables
from megaframe.parallel.context import cp_positions
from megaframe.parallel.mesh import Mesh
from megaframe.pipeline.partition import Stage


class _Step(nn.Module):
    """A parameterless module around one of the model's own methods: a module call for hooks to bracket
    (the method's params keep their global names; the bound method is a plain attribute, not a child)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class GPT(nn.Module):
    """The model, or one pipeline rank's part of it (`stage`: its chunks of global layer indices).

    forward(input_ids_BS) -> logits_BSV (this rank's vocab rows); with labels_BS -> per-token loss_BS.
    forward_chunk runs one pipeline chunk: embedding first on stage 0, head and loss last on the
    last stage. With tied embeddings the last stage keeps its own copy of `embed.weight` (same
    name, same init); its grads are summed with stage 0's: its placement is pp_tied, the last stage's
    copy the pp_duplicate.
    `tokens_per_step` (global batch x seq) scales MoE router losses like the LM loss (see moe/layer.py).
    `block`: the family's block builder (model/parallelize.py passes the one model.family names).
    """

    schedule: str | None
    """The pipeline schedule kind the stage is placed for (the step runs it; the model knows no schedule
    beyond its name); None: the run's derived kind."""
    init_spec: InitSpec | None
    """How ZeRO-3 materialises the parameters the builder left on meta (optim/zero3.py)."""
    fused_head_loss: bool
    """tp=1: the head and loss fused (layers/fused_ce.py), else the whole logits (train.fused_head_loss)."""
    float8_gathered: tuple = ()
    """The weights ZeRO-3 gathers as float8 (optim/float8_gather.py), known from shapes once the builder
    has cast the model (model/parallelize.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        mesh: Mesh,
        sp: bool = False,
        device=None,
        stage: Stage | None = None,
        tokens_per_step: int | None = None,
        recompute: str = "none",
        cp_ring: bool = False,
        param_device=None,
        block: Callable[[BlockArgs, int], nn.Module] = build_block,
        schedule: str | None = None,
        init_spec: InitSpec | None = None,
        fused_head_loss: bool = True,
    ):
        super().__init__()
        self.cfg, self.mesh = cfg, mesh
        self.schedule, self.init_spec, self.fused_head_loss = schedule, init_spec, fused_head_loss
        self.recompute_blocks = recompute if recompute in ("full", "op_selective") else None
        self.stage = stage = stage or Stage.whole(cfg.num_layers)
        # sp means nothing at tp = 1; folding it here keeps every sp branch below from also testing tp.
        self.sp = sp and mesh.tp.size > 1
        device = device or mesh.device
        # param_device="meta": parameters without storage (build_model materialises what the rank keeps);
        # every other tensor (rope tables, positions, MoE statistics) on `device`
        pdev = param_device or device
        tp = mesh.tp
        self._make_embeddings(cfg, mesh, stage, pdev)
        # the family's blocks (models/<family>/spec.py: FamilySpec.block), each told its global index
        args = BlockArgs(cfg, mesh, self.sp, pdev, tokens_per_step, recompute, cp_ring)
        self.layers = nn.ModuleDict({str(i): block(args, i) for c in stage.chunks for i in c})
        self.tokens_per_step, self.mtp = tokens_per_step, None
        if stage.last and cfg.mtp_num_layers:  # multi-token prediction's depths (model/mtp.py)
            self.mtp = mtp.build(args, block)
            # [depth, (token loss sum, tokens)] of this step; a plain attribute: no cast, not saved
            self.mtp_stats = torch.zeros((cfg.mtp_num_layers, 2), dtype=torch.float64, device=device)
        if stage.last:
            self.final_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, self.sp, pdev)
            if not cfg.tie_embeddings:
                self.head = ColumnParallelLinear(cfg.hidden_size, [cfg.vocab_size], tp, self.sp, False, pdev)
                # the output layer, not a hidden matrix: an update rule such as Muon leaves it to AdamW
                self.head.weight.placement = replace(self.head.weight.placement, role="head")
        self._make_positions(cfg, mesh, device)
        self.drop = nn.Dropout(cfg.dropout)
        self.doc_eos: torch.Tensor | None = (
            None  # end-of-document ids under data.document_mask (set_documents)
        )
        self.cp_ring = cp_ring and mesh.cp.size > 1
        self.doc_kernel: str | None = None  # tests force "flex" or "sdpa" (None: _doc_kernel's choice)
        # module calls around the two steps outside the blocks, so ZeRO-3's module hooks bracket them
        self.input_step = _Step(self._embed_tokens) if stage.first else None
        self.output_step = _Step(self._head_output) if stage.last else None
        self.head_gemm = None  # the head's Fp8Gemm under train.precision=fp8 (layers/fp8.py:enable_fp8)

    def _make_embeddings(self, cfg: ModelConfig, mesh: Mesh, stage: Stage, pdev) -> None:
        """The token embedding on the pipeline ends that use it, the learned positions on the first."""
        tp = mesh.tp
        # the last stage reads the table too with a tied head, or to embed MTP's next tokens (model/mtp.py)
        shared = cfg.tie_embeddings or cfg.mtp_num_layers > 0
        if stage.first or (stage.last and shared):
            # a copy on each pipeline end; under zbv both ends are rank 0's: one tensor, nothing to sum
            tied = shared and mesh.pp_ends.size > 1 and not (stage.first and stage.last)
            self.embed = VocabParallelEmbedding(
                cfg.vocab_size,
                cfg.hidden_size,
                tp,
                self.sp,
                pdev,
                pp_tied=tied,
                pp_duplicate=tied and not stage.first,
            )
        if stage.first and cfg.position_embedding == "learned":
            # replicated; under sp each rank adds the rows of its own sequence block
            self.pos_embed = sharded_param(
                Shard((cfg.seq_length, cfg.hidden_size)), pdev, tp_partial_grad=self.sp, role="embedding"
            )

    def _make_positions(self, cfg: ModelConfig, mesh: Mesh, device) -> None:
        """This cp rank's token positions and, under rope, its cos/sin tables."""
        # global positions of this cp rank's tokens (all of them when cp = 1)
        self.positions = cp_positions(cfg.seq_length, mesh.cp.size, mesh.cp.rank, device)
        self.rope = None
        if cfg.position_embedding == "rope":
            cos, sin = rope_tables(cfg.seq_length, cfg.rope_dim, cfg.rope_theta, device, cfg.rope_scaling)
            self.rope = (cos[self.positions], sin[self.positions]) if mesh.cp.size > 1 else (cos, sin)
            self.rope_whole = (cos, sin)  # document masking gathers rows at positions within documents

    def set_documents(self, eos_ids: list[int]) -> None:
        """data.document_mask: attention within documents,
        positions restarting at each (model/documents.py)."""
        self.doc_eos = torch.tensor(eos_ids, dtype=torch.long, device=self.positions.device)

    def init_weights(self, seed: int) -> None:
        init_model(self, seed, self.cfg.init_std, self.cfg.num_layers)

    def gather_units(self) -> list[tuple[nn.Module, list[nn.Parameter], bool]]:
        """What ZeRO-3 gathers around each use, in forward order: (module whose call brackets the use, the
        params it reads, whether its backward reads them too). The input step (embedding, learned
        positions; their backward is an index-add and an add: no weights read), each block, the output
        step (final norm and head, or the tied embedding: in one process the same param as the input's)."""
        units = []
        if self.input_step is not None:
            units.append(
                (
                    self.input_step,
                    [p for p in (self.embed.weight, getattr(self, "pos_embed", None)) if p is not None],
                    False,
                )
            )
        units += [(b, list(b.parameters()), True) for b in self.layers.values()]
        if self.output_step is not None:
            head = self.embed.weight if self.cfg.tie_embeddings else self.head.weight
            more = [] if self.mtp is None else [*self.mtp.parameters(), self.embed.weight]
            units.append(
                (self.output_step, list(dict.fromkeys([*self.final_norm.parameters(), head, *more])), True)
            )
        return units

    def embed_tokens(self, ids_BS: torch.Tensor, doc: DocContext | None = None) -> torch.Tensor:
        return self.input_step(ids_BS, doc)

    def head_output(
        self, x_SBD: torch.Tensor, labels_BS: torch.Tensor | None, loss_scale: float | None = None, rope=None
    ) -> torch.Tensor:
        return self.output_step(x_SBD, labels_BS, loss_scale, rope)

    def _embed_tokens(self, ids_BS: torch.Tensor, doc: DocContext | None = None) -> torch.Tensor:
        # Transposed to sequence-first: sp splits and gathers dim 0, contiguous (comm's convention).
        x_SBD = self.embed(ids_BS.t())
        if self.cfg.position_embedding == "learned":
            s = x_SBD.shape[0]
            # Under sp x_SBD is already this rank's sequence block: add the positions of that block.
            start = self.mesh.tp.rank * s if self.sp else 0
            if doc is not None:  # positions within each document (of this cp rank's tokens)
                x_SBD = x_SBD + self.pos_embed[doc.pos_BQ.t()[start : start + s]]
            elif self.mesh.cp.size > 1:  # this cp rank's chunks: their global rows
                x_SBD = x_SBD + self.pos_embed[self.positions[start : start + s]].unsqueeze(1)
            else:
                x_SBD = x_SBD + self.pos_embed[start : start + s].unsqueeze(1)
        if self.sp and self.mesh.tp.size > 1 and self.training and self.drop.p > 0:
            with tp_distinct(self.mesh.tp, x_SBD.device):  # each tp rank's own sequence block
                return self.drop(x_SBD)
        return self.drop(x_SBD)

    def head_weight(self) -> nn.Parameter:
        """The output head's weight_VD (this rank's vocab rows): the head's, or the tied embedding's."""
        return self.embed.weight if self.cfg.tie_embeddings else self.head.weight

    def _head_output(
        self, x_SBD: torch.Tensor, labels_BS: torch.Tensor | None, loss_scale: float | None = None, rope=None
    ) -> torch.Tensor:
        h_SBD, x_SBD = x_SBD, self.final_norm(x_SBD)
        if self.mtp is not None and labels_BS is not None and torch.is_grad_enabled():
            # MTP reads the head again: both uses take the one unfused path, so its grads add up alike
            total = mtp.losses(self, h_SBD, labels_BS, rope if rope is not None else self.rope, self._scored)
            return mtp.attach(self, self._scored(x_SBD, labels_BS), total, loss_scale)
        # head + loss fused, chunked: no full logits (train.fused_head_loss=false: the whole logits)
        if labels_BS is not None and self.mesh.tp.size == 1 and self.fused_head_loss:
            w_VD, t_SB = self.head_weight(), labels_BS.t()
            return linear_cross_entropy(x_SBD, w_VD, t_SB, self.head_gemm, loss_scale).t()
        return self._scored(x_SBD, labels_BS)

    def _scored(self, x_SBD: torch.Tensor, labels_BS: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, S, V] of normed hidden states, or with labels the per-token loss_BS (unfused)."""
        if self.cfg.tie_embeddings:
            logits_SBV = parallel_logits(x_SBD, self.embed.weight, self.mesh.tp, self.sp, self.head_gemm)
        else:
            logits_SBV = self.head(x_SBD)
        if labels_BS is None:
            return logits_SBV.transpose(0, 1)
        return vocab_parallel_cross_entropy(logits_SBV, labels_BS.t(), self.mesh.tp).t()

    def forward_chunk(
        self,
        chunk: int,
        x_SBD: torch.Tensor | None,
        input_ids_BS: torch.Tensor,
        labels_BS: torch.Tensor | None,
        loss_scale: float | None = None,
    ) -> torch.Tensor:
        """One chunk: hidden states in, hidden states out (or loss_BS / logits on the last stage).
        `loss_scale`: the upstream grad each token's loss will get (the pipeline executor's 1 / tokens per
        step), known before forward: the fused head then writes its weight grad into main_grad there."""
        doc = None
        if self.doc_eos is not None:
            doc = document_context(input_ids_BS, self.doc_eos, self.mesh.cp, self._doc_kernel())
        if chunk == 0 and self.stage.first:
            x_SBD = self.embed_tokens(input_ids_BS, doc)
        rope = self.rope_for(x_SBD.dtype, doc)
        blocks = self.recompute_blocks if self.training and torch.is_grad_enabled() else None
        for i in self.stage.chunks[chunk]:
            # full keeps only the block's input; backward re-runs its forward (same RNG: same dropout)
            if blocks == "full":
                x_SBD = checkpoint(self.layers[str(i)], x_SBD, rope, use_reentrant=False)
            elif blocks == "op_selective":  # also the kept ops' outputs (model/recompute.py)
                x_SBD = op_selective_checkpoint(self.layers[str(i)], x_SBD, rope)
            else:
                x_SBD = self.layers[str(i)](x_SBD, rope)
        if chunk == len(self.stage.chunks) - 1 and self.stage.last:
            return self.head_output(x_SBD, labels_BS, loss_scale, rope)
        return x_SBD

    def rope_for(self, dtype: torch.dtype, doc: DocContext | None = None) -> tuple | None:
        """What attention needs: the (cos, sin) tables, and under document masking per-token ones plus the
        documents. In the blocks' dtype, cast once a chunk rather than per layer and per q and k (apply_rope
        casts what it is given): every layer's rotation saves views of one pair (8 MiB a layer a
        micro-batch at 405B)."""
        rope = self.rope
        if doc is not None:
            rope = (*(rope_at(*self.rope_whole, doc.pos_BQ) if self.rope is not None else (None, None)), doc)
        if rope is None or rope[0] is None:
            return rope
        return (rope[0].to(dtype), rope[1].to(dtype), *rope[2:])

    def _doc_kernel(self) -> str:
        """Document masking's attention kernel (model/documents.py): the ring masks its own blocks; CUDA runs
        FlexAttention, except with attention dropout (flex has none): SDPA under the boolean mask, as on
        CPU."""
        if self.doc_kernel is not None:
            return self.doc_kernel
        if self.cp_ring:
            return "ring"
        dropout = self.training and self.cfg.dropout > 0
        return "flex" if self.positions.device.type == "cuda" and not dropout else "sdpa"

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        labels_BS: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] (per-token loss_BS with labels) of the whole model in one process; with
        `kv_cache` the tokens continue at kv_cache.length, each block reading and extending its cache."""
        assert self.stage.first and self.stage.last and len(self.stage.chunks) == 1, (
            "use forward_chunk under pp"
        )
        if kv_cache is None:
            return self.forward_chunk(0, None, input_ids_BS, labels_BS)
        assert self.mesh.tp.size == 1 and labels_BS is None, "decoding runs on a one-process model"
        return self._decode(input_ids_BS, kv_cache)

    def _decode(self, ids_BS: torch.Tensor, cache: KVCache) -> torch.Tensor:
        pos, s = cache.length, ids_BS.shape[1]
        x_SBD = self.embed(ids_BS.t())
        if self.cfg.position_embedding == "learned":  # the new tokens' absolute positions
            x_SBD = x_SBD + self.pos_embed[pos : pos + s].unsqueeze(1)
        for i in self.stage.chunks[0]:
            x_SBD = self.layers[str(i)](x_SBD, self.rope, cache.layer(i))
        # once per call, after every layer wrote at the same positions
        cache.length += s
        return self._head_output(x_SBD, None)
