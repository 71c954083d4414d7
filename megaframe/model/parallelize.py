"""One builder for every command: a rank's model (and optimizer) from the single-device description
(model/gpt.py's GPT for a ModelConfig), with parallelism and precision applied once, in this order:
this rank's pipeline stage (the run's schedule places chunks in a loop or a V), its tp/ep slices on the
meta device, the cast to train.precision, the init drawn straight into the slices (deferred to ZeRO-3),
fp8 GEMMs, tp comm overlap, compile; then the optimizer. Train, plan, the memory phases, generate,
evaluate and megaframe.load_model all build here, so a model is never assembled (or cast) twice. The blocks
are the family's (model.family: models/registry.py), so this module sits above models/ in the layers."""

from __future__ import annotations

import torch

from megaframe.config.choices import CPComm
from megaframe.config.schema import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megaframe.layers.fp8 import enable_fp8, float8_gathered_weights
from megaframe.layers.shard import InitSpec, init_model
from megaframe.layers.tp_overlap import enable_tp_overlap
from megaframe.model.gpt import GPT
from megaframe.models.registry import spec_of
from megaframe.optim.build import build_optimizer
from megaframe.optim.protocol import Optimizer
from megaframe.parallel.eager import arm
from megaframe.parallel.mesh import Mesh, single_process_mesh
from megaframe.pipeline.partition import Stage, stage_layout
from megaframe.pipeline.schedule import ScheduleSpec, schedule_spec

# fp8: bf16 params, float8 GEMMs
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def build_for(
    m: ModelConfig, p: ParallelConfig, t: TrainConfig, o: OptimConfig, mesh: Mesh
) -> tuple[GPT, Optimizer]:
    """This rank's model and its optimizer, from the model, parallel, train and optim groups."""
    model = build_model_for(m, p, t, o, mesh)
    return model, build_optimizer(model, o, mesh)


def rank_stage(m: ModelConfig, p: ParallelConfig, mesh: Mesh, schedule: ScheduleSpec) -> Stage:
    """This rank's chunks of layers, placed as `schedule` places them (a loop or a V); every rank derives
    its stage from the same config, so the pipeline neighbours agree on the cut."""
    return stage_layout(m.num_layers, mesh.pp.size, p.vpp, mesh.pp.rank, p.pp_layout, v=schedule.v)


def build_model_for(m: ModelConfig, p: ParallelConfig, t: TrainConfig, o: OptimConfig, mesh: Mesh) -> GPT:
    """This rank's part of the model, initialised, its parameters in the run's dtype (train.precision).

    The parameters are created on the meta device (shapes only), then each gets only its tp/ep slice, in
    the run's dtype, drawn straight into it: no fp32 copy of the local model is ever built. Under ZeRO-3
    with dp > 1 they stay on meta: the optimizer materialises this rank's owned segments only
    (optim/zero3.py, from `model.init_spec`), and the gathers give the rest when a forward needs it."""
    # parallel.pp_schedule (auto included) resolved once: the stage's placement and the step's schedule
    # (training/step.py reads model.schedule) come from the same spec
    schedule = schedule_spec(p.pp_schedule, p.vpp)
    model = GPT(
        m,
        mesh,
        p.sp,
        stage=rank_stage(m, p, mesh, schedule),
        tokens_per_step=t.global_batch_size * m.seq_length,
        recompute=t.recompute,
        cp_ring=CPComm(p.cp_comm) is CPComm.ring,
        param_device=torch.device("meta"),
        block=spec_of(m).block,
        schedule=schedule.name,
        init_spec=InitSpec(t.seed, m.init_std, m.num_layers),
        fused_head_loss=t.fused_head_loss,
    )
    # the one cast: free on a meta model; buffers too (the router keeps its bias fp32)
    model.to(PARAM_DTYPES[t.precision])
    if not deferred_init(o, mesh):
        init_model(model, t.seed, m.init_std, m.num_layers, mesh.device)
    # the blocks' GEMMs as torchao float8 (parameters stay as they are); a planning (meta) model keeps the
    # bf16 GEMMs, whose saved tensors are the same size as the float8 path's high-precision ones
    if t.precision == "fp8" and torch.device(mesh.device).type != "meta":
        enable_fp8(model, t.fp8_recipe, warn=mesh.rank == 0, head=t.fp8_head)
    # what ZeRO-3 gathers as float8 (optim/float8_gather.py), known from shapes: the planner sizes it too
    model.float8_gathered = float8_gathered_weights(model, t.precision, t.fp8_recipe, t.fp8_head)
    if p.tp_comm_overlap:
        enable_tp_overlap(model, p.tp_comm_chunks)
    # a planning (meta) model never runs: compiling its blocks would trace them through AOT's partitioner,
    # which cannot place meta tensors (a crash), and the planner sizes the eager saves and times compile
    # from the config (planning/steptime/compute.py's elementwise traffic)
    if t.compile and torch.device(mesh.device).type != "meta":
        compile_blocks(model)
    return model


def whole_model(cfg: ModelConfig, device: str = "cpu") -> GPT:
    """The whole model in one process, fp32, uninitialised: what a checkpoint is loaded into
    (megaframe.load_model, generate, evaluate); no run settings (compile, fp8, recompute) apply."""
    return GPT(cfg, single_process_mesh(device), sp=False, block=spec_of(cfg).block)


def deferred_init(o: OptimConfig, mesh: Mesh) -> bool:
    """Whether build_model leaves the parameters on meta for ZeRO-3 to materialise (build_optimizer's
    choice of Zero3Optimizer), or materialises them itself. A meta mesh (planning) never materialises."""
    return o.zero == 3 and mesh.dp.size > 1 or mesh.device.type == "meta"


def compile_blocks(model: GPT) -> None:
    """torch.compile every transformer block's forward in place (parameter names unchanged, so init,
    checkpoints and the optimizer's buffers see the same parameters). Per block, not the whole model:
    the blocks are identical, so inductor compiles one graph and reuses it; the pipeline's cuts stay
    outside, and the tp/sp collectives inside a block run eagerly between its compiled pieces (comm/).
    The forward, not the module call (Module.compile): the module's hooks (ZeRO's parameter gathers,
    waits and releases: Python with collectives) run eagerly around the compiled graph, never traced into
    it, where each would break it."""
    arm()  # the eager collectives become graph breaks (and torch._dynamo is imported) only now
    # the multi-token-prediction depths' blocks (last stage) are blocks of the same family too
    depths = [] if getattr(model, "mtp", None) is None else [d.block for d in model.mtp.values()]
    for block in [*model.layers.values(), *depths]:
        block.forward = torch.compile(block.forward, dynamic=False)
