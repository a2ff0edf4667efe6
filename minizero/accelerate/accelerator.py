"""minizero.accelerate.Accelerator: Hugging Face Accelerate's front door on minizero's engine.

    from minizero.accelerate import Accelerator            # was: from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl,
                                                                scheduler)
    for batch in train_dl:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

prepare() builds minizero's Engine (minizero.initialize) from Accelerate's settings (config.py): DDP
is the engine at ZeRO stage 0, DEEPSPEED its zero_stage, FSDP's FULL_SHARD / SHARD_GRAD_OP ZeRO-3 /
ZeRO-2. It hands back what Accelerate hands back: a model (the engine's forward, returning the
model's own outputs), an optimizer whose step() and zero_grad() the engine drives, the rank's share
of each DataLoader (data.py) and a scheduler stepped as Accelerate steps it (num_processes times per
optimizer step, once the optimizer stepped).

Where the step happens follows Accelerate's two paths. DEEPSPEED: backward() runs the engine's
backward and, at a sync step, its whole step (clip by the config's gradient_clipping, "auto" = 1.0,
optimizer, zero); clip_grad_norm_ returns the norm the engine clipped by. DDP and FSDP: the step
waits for the script, so clip_grad_norm_(max_norm) steps the engine with that clip and returns the
norm, and optimizer.step() steps it without a clip when the script did not clip.
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import NamedTuple

import numpy as np

import torch

from minizero import comm as comm_mod
from minizero.accelerate import config as acc_config
from minizero.accelerate.data import DataLoaderShard, GradientState
from minizero.accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs,
                                       DistributedType, DummyOptim, DummyScheduler, ProfileKwargs)
from minizero.runtime.config import ConfigError


class Accelerator:
    def __init__(self, device_placement: bool = True, split_batches: bool = False,
                 mixed_precision=None, gradient_accumulation_steps: int = 1, cpu: bool = False,
                 deepspeed_plugin=None, fsdp_plugin=None,
                 step_scheduler_with_optimizer: bool = True, log_with=None, project_dir=None,
                 dataloader_config=None, rng_types=None, kwargs_handlers=None, **unsupported):
        if unsupported:
            name = sorted(unsupported)[0]
            raise ConfigError(f"Accelerator({name}=...) is not covered by minizero.accelerate: see "
                              "docs/accelerate.md for the arguments it takes")
        if split_batches:
            raise ConfigError("Accelerator(split_batches=True) is not covered by "
                              "minizero.accelerate: each rank takes whole batches of the loader "
                              "(Accelerate's default)")
        if rng_types not in (None, ["generator"], ("generator",)):
            raise ConfigError(f"Accelerator(rng_types={rng_types!r}) is not covered by "
                              "minizero.accelerate: allowed None or ['generator'] (the sampler's "
                              "generator, synchronised)")
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        self.profile_handler = None
        self.fp8_recipe_handler = None  # fp8 is not covered: run_me.py prints it when set
        for handler in kwargs_handlers or ():
            # DistributedDataParallelKwargs refused anything but defaults when it was built
            if isinstance(handler, ProfileKwargs):
                self.profile_handler = handler
            elif not isinstance(handler, DistributedDataParallelKwargs):
                raise ConfigError(f"Accelerator(kwargs_handlers=[{type(handler).__name__}(...)]) "
                                  "is not covered by minizero.accelerate: it takes "
                                  "DistributedDataParallelKwargs and ProfileKwargs")
        self.log_with = log_with  # trackers are not run: init_trackers and log do nothing
        if isinstance(mixed_precision, str):
            mixed_precision = mixed_precision.lower()
        self.comm = comm_mod.get() if comm_mod.is_initialized() else None
        world = self.comm.size if self.comm else comm_mod.launched_world_size()
        self.settings = acc_config.resolve(mixed_precision, gradient_accumulation_steps, cpu,
                                           deepspeed_plugin, fsdp_plugin, world,
                                           torch.cuda.is_available())
        if self.comm is None:
            self.comm = comm_mod.init()
        if self.settings.cpu and self.comm.device.type != "cpu":
            raise ConfigError("Accelerator(cpu=True) / ACCELERATE_USE_CPU=true with a GPU present "
                              "is not covered: minizero computes where its communicator runs (one "
                              "GPU per rank when CUDA is present); hide the GPUs with "
                              "CUDA_VISIBLE_DEVICES= to train on the CPU")
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_dir = project_dir
        self.gradient_state = GradientState(self.settings.gradient_accumulation_steps)
        self.step = 0  # micro-batches since the last sync (Accelerate's accelerator.step)
        self._engines = []
        self._models = []

    # ------------------------------------------------------------------ who and where
    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType(self.settings.distributed_type)

    @property
    def state(self) -> "AcceleratorState":
        return AcceleratorState(self.distributed_type, self.num_processes, self.process_index,
                                self.local_process_index, self.device, self.mixed_precision,
                                self.settings.deepspeed_plugin, self.settings.fsdp_plugin)

    @property
    def mixed_precision(self) -> str:
        return self.settings.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int):
        """For what is prepared next (Accelerate's automatic_gradient_accumulation.py sets it, then
        calls free_memory and prepares again): an engine built before keeps its value."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"accelerator.gradient_accumulation_steps = {steps!r} is not "
                              "allowed: use a whole number >= 1")
        self.settings.gradient_accumulation_steps = steps
        self.gradient_state.num_steps = steps

    @property
    def device(self) -> torch.device:
        return torch.device(self.comm.device)

    @property
    def num_processes(self) -> int:
        return self.comm.size

    @property
    def process_index(self) -> int:
        return self.comm.rank

    @property
    def local_process_index(self) -> int:
        return comm_mod.local_rank()

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    def print(self, *args, **kwargs):
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self):
        self.comm.barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first (e.g. a dataset's map, cached), then the others."""
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self):
        yield from self._first(self.is_local_main_process)

    def _first(self, leader: bool):
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def save(self, obj, f, safe_serialization: bool = False):
        """torch.save on the main process only, as Accelerate's save (not safetensors)."""
        if safe_serialization:
            raise ConfigError("accelerator.save(safe_serialization=True) is not covered by "
                              "minizero.accelerate: allowed False (torch.save)")
        if self.is_main_process:
            torch.save(obj, f)

    # ------------------------------------------------------------------ trackers: not run
    def init_trackers(self, project_name: str, config=None, init_kwargs=None):
        """Trackers (log_with) are not run by minizero.accelerate: nothing is logged."""

    def log(self, values: dict, step=None, log_kwargs=None):
        """Not run, as init_trackers."""

    def end_training(self):
        """Accelerate's: the trackers end (none here) and every rank meets once more."""
        self.wait_for_everyone()

    # ------------------------------------------------------------------ a flag any rank can raise
    def set_trigger(self):
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every rank when a rank called set_trigger since the last check (then cleared)."""
        raised = 1.0 if getattr(self, "_trigger", False) else 0.0
        flag = torch.tensor([raised], device=self.comm.device)
        self.comm.all_reduce(flag, op="sum")
        self._trigger = False
        return bool(flag.item() >= 1)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        """Models, optimizers, DataLoaders and schedulers in any order; returned in the same
        order."""
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        schedulers = [a for a in args if isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        known = models + optimizers + loaders + schedulers
        other = [a for a in args if not any(a is k for k in known)]
        dummy = [a for a in other if isinstance(a, (DummyOptim, DummyScheduler))]
        if dummy:
            raise ConfigError(f"accelerator.prepare() got a {type(dummy[0]).__name__}: the "
                              "DeepSpeed config's optimizer / scheduler is not covered by "
                              "minizero.accelerate; remove that section and pass a torch optimizer "
                              "and LR scheduler")
        if other:
            raise ConfigError(f"accelerator.prepare() got a {type(other[0]).__name__}: "
                              "minizero.accelerate prepares torch modules, optimizers, DataLoaders "
                              "and LR schedulers")
        if len(models) > 1 or len(optimizers) > 1:
            raise ConfigError("accelerator.prepare(): one model with one optimizer per call in "
                              "minizero.accelerate (several models, as for a GAN, are not covered)")
        if optimizers and not models:
            raise ConfigError("accelerator.prepare(optimizer) without its model: pass both in the "
                              "same call (the engine rebuilds the optimizer over its shards)")
        dl_cfg = self.dataloader_config
        mapped = {id(d): DataLoaderShard(d, self.comm, self.device, self.gradient_state,
                                         dl_cfg.use_seedable_sampler, dl_cfg.data_seed)
                  for d in loaders}
        if models:
            batch_sizes = [d.batch_size for d in loaders if d.batch_size is not None]
            micro = min(batch_sizes) if batch_sizes else None
            model, opt = models[0], optimizers[0] if optimizers else None
            mapped[id(model)], wrapped_opt = self._prepare_model(model, opt, micro)
            if opt is not None:
                mapped[id(opt)] = wrapped_opt
        for s in schedulers:
            opt = next((o for o in self._engines if o.user_optimizer is s.optimizer), None)
            if opt is None:
                raise ConfigError("accelerator.prepare(scheduler): its optimizer was not prepared; "
                                  "prepare the model, its optimizer and the scheduler (built on "
                                  "that optimizer)")
            mapped[id(s)] = AcceleratedScheduler(s, opt, self)
        out = tuple(mapped[id(a)] for a in args)
        return out[0] if len(out) == 1 else out

    def _prepare_model(self, model, optimizer, micro_batch):
        if optimizer is None:  # evaluation only: Accelerate places the model; nothing to train
            return model.to(self.device), None
        from minizero.runtime.initialize import initialize
        s = self.settings
        cfg = acc_config.deepspeed_config(s, micro_batch, self.num_processes, model)
        model.to(self.device)
        engine, _, _, _ = initialize(model=model, optimizer=optimizer, config=cfg, comm=self.comm)
        wrapped = AcceleratedOptimizer(engine, optimizer, self)
        self._engines.append(wrapped)
        prepared = PreparedModel(engine, self)
        self._models.append(prepared)
        return prepared, wrapped

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def accumulate(self, *models):
        """Accelerate's: sync_gradients is True every gradient_accumulation_steps micro-batches and
        at the end of the loader; the engine reduces and steps only then."""
        state = self.gradient_state
        if state.end_of_dataloader and state.in_dataloader:
            self.step = 0
            state.sync_gradients = True
        else:
            self.step += 1
            state.sync_gradients = self.step % state.num_steps == 0
        yield

    def backward(self, loss, **kwargs):
        if kwargs:
            raise ConfigError(f"accelerator.backward({sorted(kwargs)[0]}=...) is not covered by "
                              "minizero.accelerate")
        if not self._engines:
            raise ConfigError("accelerator.backward(): prepare a model and its optimizer first")
        opt = self._engines[-1]
        opt.backward(loss, self.sync_gradients)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """DeepSpeed: the engine clipped by its config; the norm it measured. DDP/FSDP: step now,
        clipped."""
        if norm_type != 2:
            raise ConfigError(f"clip_grad_norm_(norm_type={norm_type}): minizero clips by the L2 "
                              "norm only")
        if not self._engines:
            raise ConfigError("accelerator.clip_grad_norm_(): prepare a model and its optimizer "
                              "first")
        return self._engines[-1].clip(max_norm)

    def clip_grad_value_(self, parameters, clip_value):
        raise ConfigError("accelerator.clip_grad_value_ is not covered by minizero.accelerate (the "
                          "engine clips the global norm): use accelerator.clip_grad_norm_")

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
        # DeepSpeed's weights are 16-bit already
        if dtype is None or self.settings.steps_in_backward:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=dtype):
            yield

    @contextlib.contextmanager
    def no_sync(self, model=None):
        """Accelerate's no_sync: these backward passes accumulate locally (sync_gradients False)."""
        before = self.gradient_state.sync_gradients
        self.gradient_state.sync_gradients = False
        try:
            yield
        finally:
            self.gradient_state.sync_gradients = before

    @contextlib.contextmanager
    def profile(self, profile_handler=None):
        """torch.profiler over the block (ProfileKwargs from kwargs_handlers, or the one passed);
        with output_trace_dir, each rank writes its Chrome trace there as profile_<rank>.json."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as prof:
            yield prof
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                  f"profile_{self.process_index}.json"))
            self.wait_for_everyone()

    # ------------------------------------------------------------------ across ranks
    def gather(self, tensor):
        """Every rank's tensor concatenated along dim 0 in rank order (nested lists, tuples, dicts
        too)."""
        return _recurse(tensor, self._gather_one)

    def _gather_one(self, t):
        t = t.detach().to(self.comm.device)
        one = t.reshape(1) if t.dim() == 0 else t
        out = torch.empty((self.num_processes * one.shape[0], *one.shape[1:]), dtype=one.dtype,
                          device=one.device)
        self.comm.all_gather(out, one.contiguous())
        return out

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """gather() (gather_object for anything but tensors), less the samples the last batch of the
        loader being iterated repeated so that every rank had a full one."""
        use_gather_object = use_gather_object or not _all_tensors(input_data)
        if use_gather_object:
            gathered = [x for part in self.comm.allgather_object(input_data) for x in part]
        else:
            gathered = self.gather(input_data)
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return gathered
        if use_gather_object:
            return gathered[:state.remainder]
        return _recurse(gathered, lambda t: t[:state.remainder])

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        if reduction not in ("sum", "mean"):
            raise ConfigError(f"accelerator.reduce(reduction={reduction!r}): use sum or mean")

        def one(t):
            t = t.detach().clone().to(self.comm.device) * scale
            self.comm.all_reduce(t, op="sum")
            return t / self.num_processes if reduction == "mean" else t
        return _recurse(tensor, one)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        raise ConfigError("accelerator.skip_first_batches is not covered by minizero.accelerate: "
                          "resume at an epoch's start (save_state at the end of an epoch)")

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        raise ConfigError("accelerator.pad_across_processes is not covered by minizero.accelerate: "
                          "give every rank tensors of one shape (gather_for_metrics then drops the "
                          "repeats)")

    # ------------------------------------------------------------------ models and checkpoints
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        """The user's module (under ZeRO-3 its parameters are this rank's pieces: get_state_dict
        gathers)."""
        return model.engine.module if isinstance(model, PreparedModel) else model

    def get_state_dict(self, model, unwrap: bool = True):
        """The whole model's state dict on every rank (a collective under ZeRO-3)."""
        return (
            model.engine.full_state_dict()
            if isinstance(model, PreparedModel)
            else model.state_dict()
        )

    def save_state(self, output_dir: str | None = None, **kwargs):
        """Every rank: the engine's checkpoint (model, optimizer, counters), the schedulers and this
        rank's RNG state, as Accelerate's save_state keeps them (random_states_<rank>.pkl)."""
        output_dir = output_dir or os.path.join(self.project_dir or ".", "checkpoints")
        for k, opt in enumerate(self._engines):
            client = {"schedulers": [s.scheduler.state_dict() for s in opt.schedulers],
                      "step": self.step}
            opt.engine.save_checkpoint(output_dir, tag=f"model_{k}" if k else "model",
                                       client_state=client)
        rng = {"random": random.getstate(), "numpy": np.random.get_state(),
               "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save(rng, os.path.join(output_dir, f"random_states_{self.process_index}.pkl"))
        self.wait_for_everyone()
        return output_dir

    def load_state(self, input_dir: str, **kwargs):
        for k, opt in enumerate(self._engines):
            _, client = opt.engine.load_checkpoint(input_dir, tag=f"model_{k}" if k else "model")
            for s, sd in zip(opt.schedulers, client["schedulers"]):
                s.scheduler.load_state_dict(sd)
            for user, ours in zip(opt.user_optimizer.param_groups,
                                  opt.engine.optimizer.param_groups):
                user["lr"] = ours["lr"]  # the restored learning rate, where the scheduler reads it
            self.step = client["step"]
        path = os.path.join(input_dir, f"random_states_{self.process_index}.pkl")
        if os.path.isfile(path):
            rng = torch.load(path, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["random"])
            np.random.set_state(rng["numpy"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def free_memory(self, *objects):
        for opt in self._engines:
            opt.engine.destroy()
        self._engines, self._models = [], []
        return [None] * len(objects)


class AcceleratorState(NamedTuple):
    """What accelerator.state holds in minizero: Accelerate's fields that a script reads or prints
    (config_yaml_templates/run_me.py), a snapshot taken when it is read."""
    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    mixed_precision: str
    deepspeed_plugin: object = None   # the DeepSpeedPlugin under DEEPSPEED, else None
    fsdp_plugin: object = None

    def __repr__(self):
        return (f"Distributed environment: {self.distributed_type.value}\n"
                f"Num processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\n"
                f"Device: {self.device}\n\n"
                f"Mixed precision type: {self.mixed_precision}\n")


class PreparedModel(torch.nn.Module):
    """What prepare() returns for the model: calling it runs the engine's forward and returns the
    model's own outputs (the engine alone returns the loss); train()/eval() and parameters() are the
    model's."""

    def __init__(self, engine, accelerator):
        super().__init__()
        self.engine = engine
        object.__setattr__(self, "_accelerator", accelerator)

    @property
    def module(self):
        return self.engine.module

    def forward(self, *args, **kwargs):
        with self._accelerator.autocast():
            self.engine(*args, **kwargs)
        return self.engine.outputs

    def train(self, mode: bool = True):
        self.training = mode
        self.engine.train(mode)
        return self

    def clip_grad_norm_(self, max_norm, norm_type=2):  # FSDP's model.clip_grad_norm_
        return self._accelerator.clip_grad_norm_(None, max_norm, norm_type)

    def no_sync(self):  # torch DDP's model.no_sync(): Accelerate's prepared model is one under DDP
        return self._accelerator.no_sync(self)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The optimizer prepare() returns. The engine steps its own optimizer over its shards; this
    one's step() and zero_grad() are where Accelerate's are (module docstring), and its param_groups
    are the engine's."""

    def __init__(self, engine, user_optimizer, accelerator):
        self.engine, self.user_optimizer, self.accelerator = engine, user_optimizer, accelerator
        self.schedulers = []
        self._pending = False  # DDP/FSDP: a sync backward ran, its step waits for clip or step()
        self._stepped = False      # the engine applied a step since the last scheduler step

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    @property
    def defaults(self):
        return self.user_optimizer.defaults

    @property
    def step_was_skipped(self) -> bool:
        return bool(self.engine.overflow)

    def _align(self, sync: bool):
        """The engine steps every gradient_accumulation_steps micro-steps; accumulate() may sync
        earlier (the loader's end): move the engine's count so this backward is its boundary exactly
        when it syncs."""
        engine = self.engine
        if engine.is_gradient_accumulation_boundary() == sync:
            return
        if not sync:
            raise RuntimeError("accelerator.backward: the engine would step where accumulate() "
                               "does not sync; run each micro-batch's backward inside "
                               "accelerator.accumulate(model)")
        gas = engine.gradient_accumulation_steps()
        engine.micro_steps = (engine.micro_steps // gas) * gas + gas - 1

    def backward(self, loss, sync: bool):
        if self._pending:
            raise RuntimeError("accelerator.backward: the last synced backward has not stepped "
                               "yet; call optimizer.step() (or accelerator.clip_grad_norm_) before "
                               "the next backward")
        self._align(sync)
        self.engine.backward(loss)
        if self.accelerator.settings.steps_in_backward or not sync:
            # DeepSpeed: the whole step; otherwise only the engine's micro-step count
            self._engine_step()
        else:
            self._pending = True

    def _engine_step(self, clip: float = 0.0):
        engine = self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and not self.accelerator.settings.steps_in_backward:
            engine.plan = engine.plan._replace(gradient_clipping=float(clip))
            engine.grad_norm = None
        engine.step()
        if boundary:
            self._stepped = True
            # the scheduler's "step before optimizer.step" check
            self.user_optimizer._opt_called = True

    def clip(self, max_norm: float):
        if self.accelerator.settings.steps_in_backward:
            norm = self.engine.get_global_grad_norm()
            return None if norm is None else torch.tensor(norm)
        if not self._pending:
            # not a sync step: Accelerate would clip local gradients the next sync overwrites
            return None
        self._pending = False
        self._engine_step(clip=max_norm)
        return torch.tensor(self.engine.get_global_grad_norm())

    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("optimizer.step(closure) is not covered by minizero.accelerate")
        if self._pending:
            self._pending = False
            self._engine_step()

    def zero_grad(self, set_to_none: bool = True):
        pass  # the engine zeroes after its step (Accelerate's DeepSpeed wrapper does the same)

    def train(self):
        """A schedule-free optimizer's mode (Accelerate forwards it; other optimizers have none)."""
        self._mode("train")

    def eval(self):
        self._mode("eval")

    def _mode(self, name: str):
        steps = self.engine.optimizer
        if callable(getattr(steps, name, None)):
            getattr(steps, name)()  # the optimizer over the model's own parameters (DDP, fp32)
            return
        inner = getattr(steps, "optim", None) or getattr(steps, "optimizer", None)
        if callable(getattr(inner, name, None)):
            # it would swap the values of fp32 masters or shards, not those the model computes with
            raise ConfigError(f"optimizer.{name}() of a schedule-free optimizer is covered by "
                              "minizero.accelerate at DDP in fp32 only (ZeRO stage 0, "
                              "mixed_precision no)")

    def state_dict(self):
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.engine.optimizer.load_state_dict(state_dict)


class AcceleratedScheduler:
    """Accelerate's AcceleratedScheduler: steps only after the optimizer stepped, num_processes
    times (each rank's batch is a whole batch of the loader, so one step covers num_processes of
    them); the learning rates it sets on the script's optimizer go to the engine's."""

    def __init__(self, scheduler, optimizer: AcceleratedOptimizer, accelerator):
        self.scheduler, self.optimizer, self.accelerator = scheduler, optimizer, accelerator
        optimizer.schedulers.append(self)
        self._copy_lr()

    def _copy_lr(self):
        ours, theirs = (
            self.optimizer.engine.optimizer.param_groups,
            self.optimizer.user_optimizer.param_groups,
        )
        if len(ours) != len(theirs):
            raise ConfigError(f"the scheduler's optimizer has {len(theirs)} param groups and the "
                              f"engine's {len(ours)}: minizero.accelerate cannot carry its "
                              "learning rates over")
        for o, t in zip(ours, theirs):
            # every hyperparameter the scheduler may set, not only lr: OneCycleLR cycles Adam's
            # betas (SGD's momentum) too (cv_example.py: 0.011 off Accelerate's third loss)
            for k, v in t.items():
                if k != "params" and k in o:
                    o[k] = v

    def step(self, *args, **kwargs):
        if not self.accelerator.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            self._copy_lr()
            return
        if not self.accelerator.sync_gradients:
            self.scheduler._step_count += 1  # Accelerate's adjust_scheduler
            return
        if self.optimizer.step_was_skipped or not self.optimizer._stepped:
            return
        self.optimizer._stepped = False
        for _ in range(self.accelerator.num_processes):
            if getattr(self.scheduler, "total_steps", None) is None or \
                    self.scheduler._step_count <= self.scheduler.total_steps:
                self.scheduler.step(*args, **kwargs)
        self._copy_lr()

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


def _recurse(data, fn):
    if torch.is_tensor(data):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: _recurse(v, fn) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_recurse(v, fn) for v in data)
    raise TypeError("gather/reduce take tensors (or lists, tuples, dicts of them), not "
                    f"{type(data).__name__}")


def _all_tensors(data) -> bool:
    if torch.is_tensor(data):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(v) for v in data)
    return False
