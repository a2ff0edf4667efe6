"""What every engine shares: BaseEngine (the strategy's step, the clip, the counters, the LR
scheduler, DeepSpeed's accessors, measurements, checkpoints).

    class Engine(BaseEngine): ...            # runtime/engine.py: forward, backward, step
    # runtime/pipeline_engine.py: train_batch, a schedule by composition
    class PipelineEngine(BaseEngine): ...

The clip (torch.nn.utils.clip_grad_norm_'s coefficient, max_norm / (||g|| + 1e-6) capped at 1) needs
||g|| of the whole model while each rank holds only part of it:
    ||g||^2 = sum over every rank of sum_sharded w g^2
              +  sum over pp and tp ranks of sum_replicated w g^2
(sharded pieces differ on every rank; replicated gradients are equal over dp and differ over pp and
tp) with w = 1 for an element counted here, 1/t for a tensor every tp rank holds whole (LayerNorms,
wpe), 0 for a tied copy another stage counts (runtime/strategies.norm_weights).
precision.clip_grad_norm_ is that formula; this module only calls it with the engine's groups.
"""
from __future__ import annotations

import os
import warnings

import torch

from minizero import memory
from minizero.precision import clip_grad_norm_
from minizero.runtime import checkpoint
from minizero.runtime.schedulers import build_scheduler
from minizero.runtime.strategies import Strategy, norm_weights

class BaseEngine(torch.nn.Module):
    """What the plain and the pipeline engine share, around one data-parallel strategy
    (strategies.Strategy).

    An nn.Module, as DeepSpeed's engine: `engine.module` is the user's model (registered, so
    parameters(), named_parameters(), state_dict() and to() are the module's, under "module."), and
    train()/eval() switch it. A subclass calls BaseEngine.__init__ first, sets plan, comm (every
    rank of the job), device, mesh, dp_comm, dp_rank, dp_size, module and the names a checkpoint
    maps back to (name_of, aliases, state_dict_keys, param_shapes, local_shapes, tp_split,
    tied_names), then calls _attach(strategy, model_comms). Wrappers and stages that share the
    module's parameters are held, not registered (`_hold`): the state dict names each tensor
    once."""

    # a pipeline's later-stage copies of a tied weight (saved as name@pp{s})
    tied_names: set = frozenset()

    def _hold(self, name: str, value):
        """An attribute nn.Module must not register as a submodule (it shares the module's
        parameters)."""
        object.__setattr__(self, name, value)

    def _attach(self, strategy: Strategy, model_comms: list, loss_scaler=None):
        """model_comms: the groups over which replicated gradients differ (pp stages, tp ranks)."""
        self._hold("strategy", strategy)
        self._hold("wrapped", strategy.wrapped)
        self.offload = strategy.offload
        # a torch.optim.Optimizer (offloaded: it drives the tier)
        self.optimizer = strategy.optimizer
        # checkpoints name each trained tensor
        self.param_names = strategy.param_names(self.name_of)
        self.model_comms = model_comms
        self.config = self.plan.config  # the checked config, as DeepSpeed's engine.config
        self.loss_scaler = loss_scaler  # fp16's LossScaler, or None
        self.lr_scheduler = build_scheduler(self.optimizer, self.plan.scheduler)
        self.global_steps = 0     # optimizer steps, skipped ones included (DeepSpeed's count)
        self.global_samples = 0   # samples seen, over all ranks
        self.micro_steps = 0      # backward passes
        self.skipped_steps = 0    # fp16 overflows
        self.overflow = False     # the last step was skipped
        self.grad_norm = None     # the last step's global gradient norm
        self.timings = {}         # seconds spent in the last optimizer step, by phase

    def train(self, mode: bool = True):
        self.training = mode
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def destroy(self):
        """DeepSpeed's: release what the engine holds (its strategy, optimizer and hooks'
        targets)."""
        self.strategy.finish_offload()
        self.strategy.zero_grad()
        for name in ("strategy", "wrapped", "optimizer", "offload"):
            self._hold(name, None)

    # ------------------------------------------------------------------ DeepSpeed's accessors
    def train_batch_size(self) -> int:
        return self.plan.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.plan.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the NEXT step() call steps the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def lr(self) -> float:
        return self.get_lr()[0]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    def get_global_grad_norm(self):
        """The norm before clipping, of the last applied step (None when clipping is off)."""
        return self.grad_norm

    def was_step_applied(self) -> bool:
        return not self.overflow

    # ---------------------------------------------------------------- the step's counters and clip
    def _clip_by_global_norm(self, grads, weights, shard_comm, model_comms) -> float:
        """Clip the reduced gradients (strategies.Grads) by the global norm; returns it (module
        docstring)."""
        norm = clip_grad_norm_(grads.sharded, self.plan.gradient_clipping, shard_comm,
                               replicated=grads.replicated, weights=weights[0],
                               replicated_weights=weights[1], model_comms=model_comms)
        self.grad_norm = norm.item()
        return self.grad_norm

    def _stepped(self, micro_steps: int = 0):
        """An optimizer step (applied or skipped) is over: the scheduler (when applied) and the
        counters."""
        if not self.overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.micro_steps += micro_steps
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    @property
    def local_rank(self) -> int:
        """This rank's index on its node: the launcher's LOCAL_RANK (torchrun, DeepSpeed's
        launcher), MPI's local rank under mpirun, else the global rank (one node)."""
        for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        return self.comm.rank

    @property
    def dp_world_size(self) -> int:
        return self.dp_size

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: pipeline x tensor (DeepSpeed's mpu)."""
        return self.plan.pp_size * self.plan.tp_size

    def fp16_enabled(self) -> bool:
        return self.plan.dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.plan.dtype == torch.bfloat16

    def zero_optimization(self) -> bool:
        return self.plan.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def offload_states(self, include=None, device="cpu", pin_memory=True, non_blocking=False):
        """DeepSpeed's: move the optimizer's states (include: OffloadStateTypeEnum members; None:
        all) to host memory between phases of a job, and reload_states() back. Where the engine runs
        on the CPU they are in host memory already: the call checks its arguments as DeepSpeed does
        and moves nothing. On an accelerator it is not implemented: keep them on the host for the
        whole run instead, with the config's zero_optimization.offload_optimizer {"device": "cpu"}
        (and offload_param at stage 3)."""
        from minizero.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
        allowed = [e.value for e in OffloadStateTypeEnum]
        for state in include or ():
            if getattr(state, "value", state) not in allowed:
                raise ValueError(f"offload_states: include holds {state!r}; allowed: "
                                 f"OffloadStateTypeEnum's {', '.join(allowed)}")
        device = getattr(device, "value", device)
        if device not in ("cpu", "none"):
            raise ValueError(f"offload_states: device {device!r} is not supported (DeepSpeed too "
                             "moves the states to OffloadDeviceEnum.cpu only)")
        if self.device.type != "cpu" and device == OffloadDeviceEnum.cpu.value:
            raise NotImplementedError(
                "engine.offload_states() on an accelerator is not implemented by minizero: set "
                "zero_optimization.offload_optimizer {\"device\": \"cpu\"} in the config to keep "
                "the optimizer states in host memory for the whole run")

    def reload_states(self, non_blocking=False):
        """DeepSpeed's: the states back where training uses them (see offload_states: nothing moved
        on CPU)."""
        if self.device.type != "cpu":
            raise NotImplementedError("engine.reload_states() on an accelerator is not "
                                      "implemented by minizero: see offload_states")

    def zero_offload_optimizer(self):
        return self.plan.offload_optimizer

    def zero_offload_param(self):
        return self.plan.offload_param

    def gradient_clipping(self) -> float:
        return self.plan.gradient_clipping

    def steps_per_print(self):
        return self.plan.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.plan.wall_clock_breakdown

    def get_mom(self) -> list:
        """Per param group: SGD's momentum, Adam's betas (DeepSpeed's get_mom)."""
        return [
            g["momentum"] if "momentum" in g else g.get("betas")
            for g in self.optimizer.param_groups
        ]

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        raise NotImplementedError("set_gradient_accumulation_boundary: minizero's engine counts "
                                  "micro-steps and steps every gradient_accumulation_steps() calls "
                                  "of engine.step(); set that in the config")

    def module_state_dict(self, destination=None, prefix="", keep_vars=False,
                          exclude_frozen_parameters=False):
        """The model's state dict, as DeepSpeed's (under ZeRO-3 the parameters are this rank's
        shards: use full_state_dict() for the whole model, as DeepSpeed's zero_to_fp32)."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for n, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + n, None)
        return sd

    # ------------------------------------------------------------------ the step's shared parts
    def weight_of(self):
        """name -> its weight in the global norm (module docstring), or None when every element
        counts once."""
        return None

    def clip(self, grads) -> float:
        weight_of = self.weight_of()
        weights = norm_weights(grads,
                               self.strategy.grad_names(self.param_names) if weight_of else None,
                               weight_of, self.device)
        return self._clip_by_global_norm(grads, weights, self.strategy.norm_comm(self.comm),
                              self.model_comms if self.strategy.has_replicated else [])

    def apply_step(self, grads, micro_steps: int = 0):
        """Clip (unless the step overflowed), step the strategy, count, zero the gradients."""
        if not self.overflow:
            if self.plan.gradient_clipping > 0:
                self.clip(grads)
            self.strategy.apply()
        self._stepped(micro_steps)
        self.strategy.zero_grad()

    def zero_grad(self, set_to_none: bool = True):
        self.strategy.zero_grad()

    # ------------------------------------------------------------------ measurements
    def memory(self) -> memory.Ledger:
        """The bytes this rank holds, by category (memory.measure walks the real tensors)."""
        return memory.measure(*self.strategy.memory_objects())

    def offload_traffic(self) -> dict:
        """Bytes moved device -> host, host -> device, and to/from disk since the last reset."""
        return self.strategy.offload_traffic()

    def comm_stats(self) -> dict:
        """Bytes this rank sent per collective since comm.stats.reset() (comm.CommStats.as_dict)."""
        return self.comm.stats.as_dict()

    # ------------------------------------------------------------------ checkpoints
    # (runtime/checkpoint.py)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        """Every rank writes its shard; a collective (DeepSpeed's signature). client_state: plain
        data (numbers, strings, lists, dicts, tensors), handed back by load_checkpoint. save_latest
        False: `latest` keeps naming the previous checkpoint."""
        if exclude_frozen_parameters:
            raise NotImplementedError("save_checkpoint(exclude_frozen_parameters=True): minizero's "
                                      "checkpoints always hold the frozen parameters (they are "
                                      "small here); leave it False")
        self._check_checkpointable()
        self.strategy.finish_offload()  # DPU: the checkpoint holds the update in flight
        return checkpoint.save(self, save_dir, tag, client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """-> (path, client_state), as DeepSpeed's. Validates everything on every rank before
        changing anything. As DeepSpeed: with no tag and no `latest` file in load_dir, a warning and
        (None, None), nothing loaded. load_optimizer_states False keeps this engine's optimizer
        state; load_module_only loads the weights alone (no optimizer state, scheduler, loss scale
        or counters)."""
        if not load_module_strict:
            raise NotImplementedError("load_checkpoint(load_module_strict=False): minizero's "
                                      "checkpoints load only into the same model (every name and "
                                      "shape checked); leave it True")
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...): not implemented in "
                                      "minizero; load the state dict yourself from "
                                      "engine.full_state_dict() or `minizero consolidate`")
        self._check_checkpointable()
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")) and \
                not os.path.isfile(os.path.join(load_dir, "checkpoints", "latest")):
            if self.comm.rank == 0:
                warnings.warn(f"load_checkpoint: no 'latest' file in {os.path.abspath(load_dir)}: "
                              "nothing was loaded (DeepSpeed returns (None, None) here too); pass "
                              "tag=... to load a named checkpoint",
                              stacklevel=2)
            return None, None
        out = checkpoint.load(self, load_dir, tag, optimizer_states=load_optimizer_states,
                              lr_scheduler_states=load_lr_scheduler_states,
                              module_only=load_module_only)
        if self.offload is not None:
            # DPU's warm-up resumes where it was
            self.offload.steps = self.global_steps - self.skipped_steps
        return out

    def full_state_dict(self) -> dict:
        """The plain model's state dict in fp32, on every rank (a collective: gathers the
        shards)."""
        self._check_checkpointable()
        self.strategy.finish_offload()
        return checkpoint.full_state_dict(self)

    def _check_checkpointable(self):
        """Every rank alike, before any collective: the checkpoint format has no key for an expert
        slice."""
        self.strategy.check_checkpointable()
        if self.plan.ep_size > 1:
            raise NotImplementedError("checkpoints of an engine with expert parallelism "
                                      f"(ep_size={self.plan.ep_size}) are not implemented: each ep "
                                      "rank holds other experts under the same names, and the "
                                      "format keys only tensor-parallel slices (name@tp{k})")

    def checkpoint_layout(self) -> dict:
        """How this job's ranks split the model: tp slices are saved under name@tp{k}."""
        return {"dp": self.dp_size, "pp": self.plan.pp_size, "tp": self.plan.tp_size,
                "tp_split": self.tp_split}

    def checkpoint_key(self, name: str) -> str:
        """The key this rank saves parameter `name` under."""
        key = name if self.plan.tp_size == 1 else f"{name}@tp{self.mesh.tp_rank}"
        return f"{key}@pp{self.mesh.pp_rank}" if name in self.tied_names else key

    def checkpoint_keys(self) -> list:
        """[(key, shape)] of every trained tensor this rank holds a part of."""
        return [(self.checkpoint_key(n), list(s)) for n, s in self.local_shapes.items()]

    def writes(self, segment) -> bool:
        """Whether this rank writes a segment of its strategy (a replicated one is written once)."""
        return self.strategy.writes(segment)

    def saves_extras(self) -> bool:
        """Whether this rank writes the frozen parameters and buffers (one rank of the replicas
        does)."""
        return self.dp_comm.rank == 0 and (self.mesh is None or self.mesh.tp_rank == 0)

    def extras(self) -> dict:
        """Frozen parameters and buffers (replicated, not trained, still the model's), by name."""
        raise NotImplementedError  # each engine knows where they live
