"""One block's memory as the planners size it: the meta-device forwards of a 1- and a 2-layer model (cached
per config and layout), the block re-run under full recompute, and what document masking adds to a planning
forward. The exact planner (estimate.py) and the search (search.py) both read it: a module below the two,
so neither imports the other back."""

from __future__ import annotations

import dataclasses
import functools

import torch

from megaframe.config.schema import Config


def on_host(cfg: Config) -> bool:
    """A run on the cpu: host copies are in the memory being planned (planning.memory.phases)."""
    return str(getattr(cfg.train.device, "value", cfg.train.device)) == "cpu"


def gpu_kernels(cfg: Config) -> bool:
    """Whether the run's activations are a GPU's kernels' saves (RMSNorm's fused kernel: activations.py):
    train.device=cuda, or auto where this process sees a GPU, as the trainer resolves it. `python -m
    megaframe.plan` resolves auto for the device it plans (+device, a GPU by default: plan.for_device)."""
    device = str(getattr(cfg.train.device, "value", cfg.train.device))
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def plan_documents(model, cfg: Config) -> None:
    """data.document_mask: the planning forward builds what training builds for its documents (ids,
    positions, RoPE rows, and the mask of the kernel the planned device runs: the boolean [B, 1, Q, T]
    SDPA turns into a float copy per layer on CPU or with attention dropout; FlexAttention's block mask on
    an accelerator; nothing under the ring), so the measured activations include it (model/documents.py)."""
    model.set_documents([0])  # which ids end documents changes no shape
    if not model.cp_ring:
        model.doc_kernel = "sdpa" if on_host(cfg) or cfg.model.dropout > 0 else "flex"


@functools.lru_cache(maxsize=None)
def act_per_layer(cfg_key, tp: int, recompute: str, cp: int = 1) -> tuple[int, int, int]:
    """(bytes per block, embedding extra, head + loss extra) a micro-batch of 1 saves, from meta forwards of
    a 1- and a 2-layer model and of the two stages of a 2-layer, pp=2 model."""
    from megaframe.model.parallelize import build_model_for
    from megaframe.parallel.virtual import virtual_mesh
    from megaframe.planning.memory.activations import chunk_activation_bytes

    cfg = _CFGS[cfg_key]

    def measure(layers: int, pp: int, pp_rank: int) -> int:
        c = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, num_layers=layers),
            parallel=dataclasses.replace(
                cfg.parallel, tp=tp, pp=pp, vpp=1, ep=1, sp=tp > 1, pp_layout=None, cp=cp
            ),
            train=dataclasses.replace(cfg.train, recompute=recompute, compile=False),
        )
        mesh = virtual_mesh(tp, pp, 1, pp_rank=pp_rank, device="meta", cp=cp)
        model = build_model_for(c.model, c.parallel, c.train, c.optim, mesh)
        if c.data.document_mask:  # the documents' mask and tensors, as the exact planner counts them
            plan_documents(model, c)
        # the compiled blocks' saves from the run's own train.compile (the meta model itself is eager)
        return chunk_activation_bytes(model, 0, 1, True, cfg.train.compile, gpu_kernels(cfg))

    # a 2-layer minus a 1-layer model: one block's bytes, the embedding and head cancel out
    per_layer = measure(2, 1, 0) - measure(1, 1, 0)
    return per_layer, measure(2, 2, 0) - per_layer, measure(2, 2, 1) - per_layer


_CFGS: dict[int, Config] = {}


def working_set_bytes(cfg: Config, tp: int, cp: int, recompute: str, micro_batch: int) -> int:
    """Under full recompute, the backward of a block first re-runs its forward: that block's whole saved
    set (what recompute=none keeps for one block) is live beside the checkpoints, once per rank. Under
    op_selective the same re-run rebuilds what the block did not keep: the rest of that set."""
    if recompute not in ("full", "op_selective"):
        return 0
    _CFGS[id(cfg)] = cfg
    whole = act_per_layer(id(cfg), tp, "none", cp)[0]
    kept = act_per_layer(id(cfg), tp, recompute, cp)[0] if recompute == "op_selective" else 0
    return micro_batch * (whole - kept)
