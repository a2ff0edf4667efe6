"""The data-parallel strategies that expert parallelism adds to the engine's chain.

ExpertDDPStrategy / ExpertZero1Strategy (stage 0 / 1 with MoE layers of ep_size > 1, DeepSpeed-MoE's
expert-data parallelism): dense gradients all-reduced over mesh.dp, expert ones over mesh.expert_dp
(dp/ep ranks), both divided by dp (minizero/moe/expert_data_parallel.py gives the equation and the
bytes). Gradients accumulate locally until the boundary (one reduction per step, as DDP's no_sync);
ZeRO-1 reduce-scatters each group's flat buffer over its own group instead. For the global norm at
stage 0 the expert gradients count as `sharded` (each ep rank holds other experts), weighted
1/(dp/ep) by the engine because dp/ep ranks hold each one (runtime/engine.py weight_of).
"""
from __future__ import annotations

import torch

from minizero.moe import is_expert
from minizero.runtime.strategies import DDPStrategy, Grads, Strategy, run_segments


class ExpertDDPStrategy(DDPStrategy):
    """Stage 0 with experts: every rank holds its dense parameters and E/ep experts whole (module
    docstring)."""

    # the expert gradients differ across the ep ranks: their squares add up over the world
    shards = True
    broadcasts_buffers = True  # no wrapper: reduced_grads does both all-reduces at the boundary

    def __init__(self, model, mesh, spec):
        self.mesh = mesh     # dense gradients over mesh.dp, expert ones over mesh.expert_dp
        super().__init__(model, mesh.dp, spec)
        # param.expert_parallel (moe/experts.py)
        self.expert = {id(p) for p in self.params if is_expert(p)}

    def _wrapper(self, model, comm, spec):
        """No DDP: one start on every rank instead, the dense parameters and buffers of dp rank 0,
        each expert's of its group's first."""
        expert = {id(p) for p in self.trainable(model) if is_expert(p)}
        self.mesh.dp.broadcast_tensors([p for p in model.parameters() if id(p) not in expert]
                                       + list(model.buffers()))
        self.mesh.expert_dp.broadcast_tensors([p for p in self.trainable(model) if id(p) in expert])
        return None

    def expert_names(self, name_of) -> set:
        return {name_of[id(p)] for p in self.params if id(p) in self.expert}

    def reduced_grads(self) -> Grads:
        from minizero.moe import reduce_gradients
        reduce_gradients(self.model, self.mesh.dp, self.mesh.expert_dp)
        # in _trained() order (fp32 masters' under 16 bits)
        grads = super().reduced_grads().replicated
        trained = [p for p, _ in self._trained() if p.grad is not None]
        return Grads([g for p, g in zip(trained, grads) if id(p) in self.expert],
                     [g for p, g in zip(trained, grads) if id(p) not in self.expert])

    def grad_names(self, name_of):
        trained = [p for p, _ in self._trained() if p.grad is not None]
        return ([name_of[id(p)] for p in trained if id(p) in self.expert],
                [name_of[id(p)] for p in trained if id(p) not in self.expert])


class ExpertZero1Strategy(Strategy):
    """Stage 1 with experts: two ZeRO-1 optimizers (zero.ShardedOptimizer), the dense parameters'
    sharded over mesh.dp and the experts' over mesh.expert_dp (DeepSpeed-MoE shards each over its
    own group). The expert shard is averaged over dp/ep ranks by its reduce-scatter, then divided by
    ep: / dp in all (module docstring). Both shards are `sharded` gradients: over the world each
    element is held once. The scheduler drives the dense optimizer (engine.optimizer); its
    hyperparameters are copied to the expert one before each step."""

    has_replicated = False
    broadcasts_buffers = True

    def __init__(self, model, mesh, spec):
        super().__init__(model, mesh.dp, spec)
        from minizero.zero.sharded_optimizer import ShardedOptimizer
        params = self.trainable(model)
        self.mesh = mesh         # dense over mesh.dp, experts over mesh.expert_dp
        self.expert = {id(p) for p in params if is_expert(p)}
        comm_of = {"dense": mesh.dp, "expert": mesh.expert_dp}
        mesh.dp.broadcast_tensors(
            [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
        )
        self.optimizers = {
            kind: ShardedOptimizer(
                [p for p in params if (id(p) in self.expert) == (kind == "expert")],
                spec.optimizer_cls,
                comm_of[kind],
                **spec.optimizer_kwargs,
            )
            for kind in ("dense", "expert")
        }
        self.optimizer = self.optimizers["dense"]  # what the engine's scheduler drives
        self._shards = None

    def expert_names(self, name_of) -> set:
        return set()  # each expert element is in one shard of the world: no weight for the norm

    def reduced_grads(self) -> Grads:
        from minizero import memory
        dense = self.optimizers["dense"].reduce_gradients()
        # both shards live at once, each ShardedOptimizer
        # books its own as "zero1.grad_shard": rename the first
        memory.transient.free("zero1.grad_shard")
        memory.transient.alloc("zero1.grad_shard.dense", dense)
        expert = self.optimizers["expert"].reduce_gradients()
        expert.div_(self.mesh.ep_size)  # averaged over dp/ep ranks; the global mean divides by dp
        self._shards = [opt.gradient_for_step(g) for opt,
                        g in zip(self.optimizers.values(), (dense, expert))]
        return Grads(list(self._shards), [])

    def grad_names(self, name_of):
        """Per shard: [(name, shard_lo, numel)] of the pieces this rank holds, and the shard's
        size."""
        return [([(name_of[id(opt.params[pc.index])], pc.shard_lo, pc.hi - pc.lo)
                  for pc in opt.layout.pieces(opt.comm.rank)],
                 opt.layout.shard_numel) for opt in self.optimizers.values()], []

    @torch.no_grad()
    def apply(self):
        dense, expert = self.optimizers["dense"], self.optimizers["expert"]
        # the scheduler's lr reaches the experts
        for mine, theirs in zip(expert.param_groups, dense.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for opt, shard in zip(self.optimizers.values(), self._shards):
            opt.step_gradient(shard)

    def zero_grad(self):
        from minizero import memory
        dense, expert = self.optimizers["dense"], self.optimizers["expert"]
        expert.zero_grad()  # frees its "zero1.grad_shard"
        if dense.grad_shard is not None:  # the name dense's zero_grad frees
            memory.transient.free("zero1.grad_shard.dense")
            memory.transient.alloc("zero1.grad_shard", dense.grad_shard)
        dense.zero_grad()
        self._shards = None

    def segments(self, name_of):
        """Both optimizers' shards (the engine refuses checkpoints with ep > 1: names repeat across
        ep ranks)."""
        return [seg for opt in self.optimizers.values() for seg in run_segments(opt, name_of)]

    def memory_objects(self):
        return (self.model, *self.optimizers.values())
