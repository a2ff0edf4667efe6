"""minizero.moe: mixture of experts with expert parallelism (the ep dimension).

    router.py               TopKRouter: softmax gate, top-1/top-2, capacity, the balancing loss
                            (Switch/GShard)
    dispatch.py             slots per expert, dispatch, the all-to-all exchanges, combine (lab 12);
                            all_to_all_bytes, the formula a test measures
    experts.py              Experts: E/ep two-layer MLPs per rank, sliced from the full set
    moe_layer.py            MoELayer: router -> dispatch -> all-to-all -> experts -> all-to-all ->
                            combine
    expert_data_parallel.py reduce_gradients: dense over mesh.dp, experts over mesh.expert_dp
    moe.py                  MoE: DeepSpeed's deepspeed.moe.layer.MoE(hidden_size, expert,
                            num_experts, ep_size, k, capacity_factor, ...) -> (out, l_aux,
                            exp_counts); the engine sets its ep group
    layer.py, utils.py      DeepSpeed's import paths: layer.MoE,
                            utils.split_params_into_different_moe_groups_...

The groups come from the Mesh: `Mesh(comm, ep=2)` cuts each dp group into slices of 2 ranks
(mesh.ep, the all-to-all group) and gives mesh.expert_dp (the ranks holding the same experts).
"""
# the module `dispatch` stays a module: MoELayer's default ops
from minizero.moe.dispatch import all_to_all_bytes
from minizero.moe.expert_data_parallel import gradient_bytes, is_expert, reduce_gradients
from minizero.moe.experts import Experts
from minizero.moe.moe import MoE
from minizero.moe.moe_layer import MoELayer
from minizero.moe.router import Routing, TopKRouter, capacity, load_balancing_loss
# deepspeed.moe.layer and deepspeed.moe.utils as attributes
from minizero.moe import layer, utils  # noqa: F401

__all__ = ["Experts", "MoE", "MoELayer", "Routing", "TopKRouter", "all_to_all_bytes", "capacity",
           "gradient_bytes", "is_expert", "load_balancing_loss", "reduce_gradients"]
