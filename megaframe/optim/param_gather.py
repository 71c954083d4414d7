"""The all-gather of updated parameter buckets after a ZeRO step, optionally overlapped with the next
forward (optim.overlap_param_gather, Megatron's --overlap-param-gather).

Without overlap, step() waits for every bucket, so parameters are whole when it returns. With overlap,
step() only launches the all-gathers, in the order forward needs them (`_hook_sites`: the params
outside the transformer blocks, then block by block), and a forward pre-hook on the model and on each
block waits for the gathers up to the last bucket it needs. Gathers on one group complete in launch
order, so waiting "up to k" is what the wire does anyway.
`wait()` finishes everything: whoever reads parameters outside a forward (checkpoints, tests, the next
step, backward) calls it first; it is a no-op when nothing is in flight.
"""

from __future__ import annotations

from torch import nn

from megaframe.parallel.eager import eager


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (`model.layers`), in forward order; none for another module."""
    layers = getattr(model, "layers", None)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else []


def gather_units(model: nn.Module) -> list[tuple[nn.Module, list, bool]]:
    """The model's gather units (GPT.gather_units: input step, blocks, output step), or, for another
    module, its transformer blocks (the rest then stays gathered: the resident bucket)."""
    if hasattr(model, "gather_units"):
        return [(m, ps, bwd) for m, ps, bwd in model.gather_units() if ps]
    return [(b, list(b.parameters()), True) for b in blocks_of(model)]


def unit_groups(units) -> list[list]:
    """One bucket's params per group: each unit's own params together; a param read by two units (a tied
    embedding in one process) or summed over the pipeline ends (pp_tied: its bucket is `late`, its grad
    kept whole for the step) in a group of its own, so a unit gathers and a late bucket holds no more
    than needed."""
    uses: dict = {}
    for _, ps, _ in units:
        for p in ps:
            uses[id(p)] = uses.get(id(p), 0) + 1
    groups, alone = [], {}
    for _, ps, _ in units:
        own = []
        for p in ps:
            if uses[id(p)] > 1 or p.placement.pp_tied:
                alone.setdefault(id(p), [p])
            else:
                own.append(p)
        groups.append(own)
    return [g for g in groups + list(alone.values()) if g]


def zero3_groups(params: list, units) -> list[list]:
    """zero=3's bucket groups of one buffer's params (buffer.group_plan): first the params no unit reads
    (kept gathered: the resident bucket), then unit_groups."""
    in_units = {id(p) for _, ps, _ in units for p in ps}
    return [[p for p in params if id(p) not in in_units]] + unit_groups(units)


def gathers_per_step(p, units, microbatches: int, reshard: bool) -> int:
    """How often zero=3 all-gathers the bucket holding p in one step: once per use per micro-batch (a
    forward, and a backward where the unit's backward reads it), once a step without resharding after
    forward, and once (after the update) for a param no unit reads."""
    uses = [1 + bwd for _, ps, bwd in units if any(q is p for q in ps)]
    return sum(uses) * microbatches if uses and reshard else 1


def _hook_sites(model: nn.Module) -> list[tuple[nn.Module, list]]:
    """(module, params its forward pre-hook waits for), in the order forwards run. A pipeline rank's
    forward is `forward_chunk`, not a call of the model, so the hooks sit on the modules it calls:
        embed        the input embedding and every other param outside blocks and head (pos_embed)
        each block   all of its params, one hook at its entry (a block may be torch.compile'd whole: a
                     hook inside it would break its graph at every sub-module)
        final_norm   every param outside the blocks: the output head's weight (or the tied embedding's
                     copy on the last stage) is read right after it, not through a module call
    A model without these (another module) waits at its own entry for everything outside blocks."""
    blocks = blocks_of(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    embed, final_norm = getattr(model, "embed", None), getattr(model, "final_norm", None)
    if not isinstance(embed, nn.Module) and not isinstance(final_norm, nn.Module):
        sites = [(model, outside)] + [(b, list(b.parameters())) for b in blocks]
    else:
        head = {
            id(p)
            for m in (final_norm, getattr(model, "head", None))
            if isinstance(m, nn.Module)
            for p in m.parameters()
        }
        sites = [(embed, [p for p in outside if id(p) not in head])] if isinstance(embed, nn.Module) else []
        sites += [(b, list(b.parameters())) for b in blocks]
        sites += [(final_norm, outside)] if isinstance(final_norm, nn.Module) else []
    return [(m, ps) for m, ps in sites if ps]


class ParamGather:
    """Launches and waits for the param all-gathers of a ZeroOptimizer's buffers."""

    def __init__(self, model: nn.Module, buffers: list, overlap: bool):
        # A shard axis of 1 gathers nothing: no hooks to wait on (each would be a graph break at a compiled
        # block's entry, or a Python call per module per micro-batch)
        overlap = overlap and any(buf.axis.size > 1 for buf in buffers)
        self.buffers, self.overlap = buffers, overlap
        self.works: list = []  # Work or None, in launch order
        self.waited = 0  # works[:waited] are done
        # launch order: the buckets the earliest hook needs first (the same on every rank: same model)
        sites = _hook_sites(model)
        bucket = {p: (buf, buf.bucket_of[p]) for buf in buffers for p in buf.bucket_of}
        self.launch_order: list = []
        index: dict = {}
        for _, params in sites:
            for p in params:
                if p in bucket and id(bucket[p][1]) not in index:
                    index[id(bucket[p][1])] = len(self.launch_order)
                    self.launch_order.append(bucket[p])
        for buf in buffers:  # buckets no hook needs (none in a GPT): last
            for b in buf.buckets:
                if id(b) not in index:
                    index[id(b)] = len(self.launch_order)
                    self.launch_order.append((buf, b))
        self.hooks = []
        if overlap:
            for module, params in sites:
                need = [index[id(bucket[p][1])] for p in params if p in bucket]
                if need:
                    # One wait up to the last bucket needed: gathers complete in launch order anyway.
                    self.hooks.append(module.register_forward_pre_hook(self._pre_hook(max(need))))

    def _pre_hook(self, upto: int):
        @eager  # a wait on a Work: never traced into a compiled graph
        def hook(module, args):
            self.wait(upto)

        return hook

    def launch(self, gather_bucket) -> None:
        """gather_bucket(buf, b) -> Work | None starts one bucket's all-gather; called in launch order."""
        # The previous step's gathers must land first: the new ones write into the same param buffer.
        self.wait()
        self.works = [gather_bucket(buf, b) for buf, b in self.launch_order]
        self.waited = 0
        if not self.overlap:
            self.wait()

    def wait(self, upto: int | None = None) -> None:
        """Wait for the gathers of launch index <= upto (all by default)."""
        end = len(self.works) if upto is None else min(upto + 1, len(self.works))
        # In launch order, so works[:waited] is always a landed prefix and one counter tracks it.
        while self.waited < end:
            w = self.works[self.waited]
            if w is not None:
                w.wait()
            self.waited += 1

    @property
    def in_flight(self) -> int:
        return len(self.works) - self.waited
