"""The links of the engine's chain that both engines build (runtime/engine.py, runtime/pipeline_engine.py):
the names a checkpoint maps back to, and what the data-parallel strategy is built from (activation
checkpointing is minizero.activation_checkpointing.checkpoint_blocks, called as it is). Each is a
function of the resolved Plan (runtime/resolve.py) and the model."""
from __future__ import annotations

from minizero.runtime.resolve import Plan
from minizero.runtime.strategies import StrategyPart


def strategy_part(plan: Plan, model, comm, node_mesh=None, runtime_syncs=False) -> StrategyPart:
    """The resolved plan -> what the data-parallel strategy is built from."""
    zero = plan.config["zero_optimization"]
    hpz = zero["zero_hpz_partition_size"]
    zeropp = None
    if zero["zero_quantized_weights"] or zero["zero_quantized_gradients"] or hpz > 1:
        from minizero.comm import Mesh
        zeropp = {"quantized_weights": zero["zero_quantized_weights"], "hpz": hpz > 1,
                  "quantized_gradients": zero["zero_quantized_gradients"],
                  "mesh": node_mesh or Mesh(comm, node_size=hpz if hpz > 1 else None)}
    return StrategyPart(optimizer_cls=plan.optimizer_cls, optimizer_kwargs=plan.optimizer_kwargs, groups=plan.groups,
                        dtype=plan.dtype, bucket_numel=int(zero["reduce_bucket_size"]),  # elements, as DeepSpeed's
                        overlap=zero["overlap_comm"],
                        prefetch=zero["overlap_comm"] and zero["stage3_prefetch_bucket_size"] > 0,
                        persistence_threshold=int(zero["stage3_param_persistence_threshold"]), zeropp=zeropp,
                        zero_init=plan.zero_init, offload=plan.offload, runtime_syncs=runtime_syncs)


def model_names(model) -> tuple[dict, dict, list]:
    """What a checkpoint maps back to the plain model: {id(param): name}, {alias: name} (tied weights'
    other names), the state dict's keys; and [(name, shape)] of the trainable parameters."""
    first, aliases = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), n) != n:
            aliases[n] = first[id(p)]
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    return first, aliases, list(model.state_dict().keys()), shapes
