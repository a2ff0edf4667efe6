"""The engine's chain, one function per link, each a function of the resolved EnginePlan
(runtime/resolve.py). docs/design.md draws it; runtime/engine.py calls it in this order:

    mesh  = build_mesh(plan, world)                     # dp x cp x tp (ep slices of dp), or None
    model = apply_tensor_parallel(model, plan, mesh)    # split over mesh.tp (Megatron)
    apply_sparse_attention(model, plan)  # block-sparse layouts (DeepSpeed's sparse attention)
    apply_context_parallel(model, plan, mesh)           # whole sequences in, s/cp tokens per rank
    apply_expert_parallel(model, plan, mesh)            # each MoE layer keeps E/ep experts
    blocks = apply_activation_checkpointing(model, plan)
    apply_precision(model, plan, device)                # the model in its training dtype
    # DDP, ZeRO-1/2/3, ZeRO++, hybrid; offload inside
    strategy = select_strategy(plan, model, dp_comm, mesh)

The pipeline engine (runtime/pipeline_engine.py) cuts the model into its stage between TP and the
strategy.
"""
from __future__ import annotations

from minizero.runtime.resolve import EnginePlan
from minizero.runtime.strategies import (
    DDPStrategy,
    HybridShardStrategy,
    OneBitAdamStrategy,
    Strategy,
    StrategySpec,
    Zero1Strategy,
    Zero2Strategy,
    Zero3Strategy,
)


def build_mesh(plan: EnginePlan, world):
    """A dp x cp x tp Mesh (ep slices of dp) when the plan splits the model, else None."""
    if plan.tp_size == 1 and plan.cp_size == 1 and plan.ep_size == 1:
        return None
    from minizero.comm import Mesh
    return Mesh(world, tp=plan.tp_size, cp=plan.cp_size, ep=plan.ep_size)


def apply_tensor_parallel(model, plan: EnginePlan, mesh):
    """The model split over mesh.tp (tensor.TensorParallelGPT, with sequence parallelism if
    asked)."""
    if plan.tp_size == 1:
        return model
    from minizero.tensor import TensorParallelGPT
    return TensorParallelGPT(model, mesh.tp, plan.sequence_parallel)


def apply_sparse_attention(model, plan: EnginePlan):
    """Every attention runs the plan's block-sparse layout (sparse/; DeepSpeed's sparse_attention
    section)."""
    if plan.sparse_attention is not None:
        from minizero.sparse import apply_sparse_attention as apply
        apply(model, plan.sparse_attention)


def apply_context_parallel(model, plan: EnginePlan, mesh):
    """The model's hook (TinyGPT's) takes whole sequences and keeps this rank's s/cp tokens: Ulysses
    or ring."""
    if plan.cp_size > 1 and plan.cp_attention == "ring":
        # chunks r and 2cp-1-r, ring attention
        model.set_context_parallel(mesh.cp, attention="ring")
    elif plan.cp_size > 1:
        # contiguous s/cp tokens, Ulysses (a model may know only this)
        model.set_context_parallel(mesh.cp)


def apply_expert_parallel(model, plan: EnginePlan, mesh):
    """Each MoE layer keeps E/ep experts and exchanges tokens over mesh.ep."""
    if plan.ep_size > 1:
        from minizero.runtime.resolve import moe_layers
        for layer in moe_layers(model):
            layer.set_expert_parallel(mesh.ep)


def apply_activation_checkpointing(model, plan: EnginePlan) -> list:
    """Every block of every nn.ModuleList recomputes in backward (activation_checkpointing.py)."""
    if not plan.activation_checkpointing:
        return []
    from minizero.activation_checkpointing import checkpoint_blocks
    return checkpoint_blocks(model)


def apply_precision(model, plan: EnginePlan, device):
    """The model in its training dtype on the device (zero.Init's recorder rounds as model.to(dtype)
    would)."""
    if plan.zero_init is not None:
        plan.zero_init.dtype = plan.dtype if plan.mixed_precision else None
    else:
        model.to(device, plan.dtype if plan.mixed_precision else None)


def strategy_spec(plan: EnginePlan, node_mesh=None, runtime_syncs: bool = False) -> StrategySpec:
    """The plan's fields a strategy is built from."""
    return StrategySpec(optimizer_cls=plan.optimizer_cls, optimizer_kwargs=plan.optimizer_kwargs,
                        groups=plan.groups, dtype=plan.dtype, bucket_numel=plan.bucket_numel,
                        overlap=plan.overlap_comm, prefetch=plan.prefetch,
                        persistence_threshold=plan.persistence_threshold, zeropp=plan.zeropp,
                        node_mesh=node_mesh, zero_init=plan.zero_init, offload=plan.offload,
                        runtime_syncs=runtime_syncs, shard_layout=plan.shard_layout,
                        master_dtype=plan.master_dtype)


def select_strategy(
    plan: EnginePlan, model, comm, mesh=None, node_mesh=None, runtime_syncs: bool = False
) -> Strategy:
    """The one place a plan becomes a data-parallel strategy, keyed by what the plan asks for.
    comm: the ranks that reduce (and shard); mesh: the engine's (experts need mesh.dp and
    mesh.expert_dp); node_mesh: the nodes ZeRO++ uses, if the caller has them
    (initialize(mesh=...))."""
    # The stage is read once, here; the variants below are keyed by their own fields, which the
    # config allows only at the stages they need (runtime/config.py: ZeRO++ and MiCS at 3, experts
    # at 0-1, 1-bit Adam at 0).
    if plan.ep_size > 1:  # MoE: experts reduced over mesh.expert_dp, dense parameters over mesh.dp
        from minizero.runtime.expert_strategy import ExpertDDPStrategy, ExpertZero1Strategy
        cls = {0: ExpertDDPStrategy, 1: ExpertZero1Strategy}[plan.stage]
        return cls(model, mesh, strategy_spec(plan))
    from minizero.compression import OneBitAdam
    if issubclass(plan.optimizer_cls, OneBitAdam):  # the optimizer reduces, no wrapper
        return OneBitAdamStrategy(model, comm, strategy_spec(plan))
    if plan.mics_shard_size is not None:
        from minizero.comm import Mesh
        return HybridShardStrategy(model, comm,
                                   strategy_spec(plan, Mesh(comm, node_size=plan.mics_shard_size)))
    if plan.zeropp is not None:
        from minizero.comm import Mesh
        hpz = plan.zeropp.hpz_partition_size
        nodes = node_mesh or Mesh(comm, node_size=hpz if hpz > 1 else None)
        return Zero3Strategy(model, comm, strategy_spec(plan, nodes))
    cls = {0: DDPStrategy, 1: Zero1Strategy, 2: Zero2Strategy, 3: Zero3Strategy}[plan.stage]
    return cls(model, comm, strategy_spec(plan, runtime_syncs=runtime_syncs))


def model_names(model) -> tuple[dict, dict, list, list]:
    """What a checkpoint maps back to the plain model: {id(param): name}, {alias: name} (tied
    weights' other names), the state dict's keys; and [(name, shape)] of the trainable
    parameters."""
    first, aliases = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), n) != n:
            aliases[n] = first[id(p)]
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    return first, aliases, list(model.state_dict().keys()), shapes
