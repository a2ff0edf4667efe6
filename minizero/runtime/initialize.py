"""minizero.initialize: DeepSpeed's front door, with DeepSpeed's signature and its 4-tuple.

    engine, optimizer, dataloader, lr_scheduler = minizero.initialize(
        args=args, model=model, model_parameters=groups, training_data=dataset,
        config="ds_config.json")

What each argument means here (deepspeed.initialize's, checked against deepspeed/__init__.py):
  args              an argparse Namespace; its `deepspeed_config` is the config when `config` is not
                    given (both given: an error, as in DeepSpeed). Nothing else is read from it.
  model             the torch.nn.Module to train.
  optimizer         a torch.optim.Optimizer built on the model (nanoGPT's configure_optimizers): its
                    class, defaults and param groups become the engine's, since ZeRO must build the
                    optimizer over its own shards (DeepSpeed wraps it the same way). A config
                    "optimizer" section is then not used (as in DeepSpeed: rank 0 warns).
                    A callable (params -> Optimizer) is refused with the line to write instead.
  model_parameters  param groups (or an iterable of parameters), every trainable parameter in one
                    group.
  training_data     a torch Dataset: the returned DataLoader gives this data-parallel rank its share
                    (DistributedSampler over the dp ranks) in train_micro_batch_size_per_gpu
                    batches. A pipeline engine also reads it in train_batch() (in order, repeating:
                    DeepSpeed's RepeatingLoader).
  lr_scheduler      a callable (optimizer -> scheduler), called on the engine's optimizer; the
                    engine steps it at each optimizer step. A scheduler object built on your own
                    optimizer is refused: it would move the learning rate of an optimizer nothing
                    steps.
  config / config_params   a dict or a JSON path (config_params: DeepSpeed's older name).
  distributed_port, dist_init_required   accepted and unused: minizero starts its communicator
                                         itself.
minizero's own keywords: comm= (a Communicator) and mesh= (a comm.Mesh whose nodes ZeRO++ uses).

The return value is DeepSpeed's tuple (engine, optimizer, training_dataloader, lr_scheduler); the
last two are None when nothing was asked for. A bad config or argument is a ConfigError, raised
before any collective; in a user's own job of several ranks (mpirun or torchrun running the script)
every rank finds it alike, so rank 0 says it in one line and the job exits 2, instead of one
traceback per rank. In a job of several ranks it also starts the collective watchdog and the
job's reaper (comm/watchdog.py), as `minizero train` does. `engine = minizero.initialize(...)` is a
mistake DeepSpeed users do not make but others do: the tuple's attribute errors (and calling it) say
which line to write.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, NamedTuple

import torch

from minizero.runtime.config import ConfigError
from minizero.runtime.engine import build_engine


class Initialized(NamedTuple):
    """deepspeed.initialize's return value."""
    engine: Any  # the Engine (or PipelineEngine): forward, backward, step, train_batch
    optimizer: Any  # engine.optimizer: a torch.optim.Optimizer over what this rank trains
    training_dataloader: Any   # a DataLoader over this dp rank's share of training_data, or None
    lr_scheduler: Any          # engine.lr_scheduler, or None

    def __getattr__(self, name):
        raise AttributeError("minizero.initialize() returns DeepSpeed's 4-tuple, not the engine "
                             f"(no attribute {name!r}): write `engine, optimizer, _, _ = "
                             "minizero.initialize(...)`")

    def __call__(self, *args, **kwargs):  # `engine = minizero.initialize(...)`, then engine(x, y)
        raise TypeError("minizero.initialize() returns DeepSpeed's 4-tuple, not the engine (the "
                        "tuple cannot be called): write `engine, optimizer, _, _ = "
                        "minizero.initialize(...)`, then engine(x, y)")


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    config_params=None,
    *,
    comm=None,
    mesh=None,
) -> Initialized:
    """DeepSpeed's initialize. Every error is raised before any collective (runtime/resolve.py)."""
    try:
        return _initialize(args, model, optimizer, model_parameters, training_data, lr_scheduler,
                           collate_fn, config, config_params, mpu, comm, mesh)
    except ConfigError as e:
        if _users_own_job():
            _end_job(f"minizero.initialize: {e}")
        raise


def _in_launch_worker() -> bool:
    """This process is minizero.launch's worker (the suite's and the lessons' jobs), not the user's
    script."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main, "name", None) == "minizero.launch"


def _users_own_job() -> bool:
    """Several ranks run the user's script (not minizero.launch's worker, which reports a rank's
    error itself)."""
    from minizero import comm as comm_mod
    return comm_mod.launched_world_size() > 1 and not _in_launch_worker()


def _end_job(message: str):
    """Every rank found the same bad input: said once for the job, exit 2 (comm/watchdog.end_job's
    vote where the communicator exists; before it, no rank has started MPI or a rendezvous, so each
    just exits)."""
    from minizero import comm as comm_mod
    from minizero.comm import watchdog
    world = comm_mod.get() if comm_mod.is_initialized() else None
    if world is not None and world.size > 1:
        watchdog.start(world)  # the job directory the vote is taken in
        watchdog.end_job(world, message, 2)
    if comm_mod.launched_rank() == 0:
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
    sys.exit(2)


def _initialize(args, model, optimizer, model_parameters, training_data, lr_scheduler, collate_fn,
                config, config_params, mpu, comm, mesh) -> Initialized:
    if isinstance(args, torch.nn.Module):
        raise TypeError("minizero.initialize takes DeepSpeed's keywords: initialize(model=model, "
                        "config=cfg) (its first positional argument is DeepSpeed's `args`)")
    if model is None:
        raise TypeError("minizero.initialize: pass the model as model=...")
    if mpu is not None:
        raise ConfigError("mpu (Megatron's model-parallel unit) is not supported: set "
                          "tensor_parallel.autotp_size and pipeline.stages in the config instead")
    config = _config(args, config, config_params)
    client = None
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("optimizer= must be a torch.optim.Optimizer built on the model (a "
                              "callable is not supported): optimizer=torch.optim.AdamW(groups, "
                              "lr=...)")
        if optimizer.state:
            raise ConfigError("optimizer= has already stepped (it holds state): pass a fresh one; "
                              "ZeRO rebuilds the optimizer over its shards and would drop that "
                              "state")
        # its hyperparameters as its constructor takes them (torch's AdamW keeps Adam's
        # decoupled_weight_decay in its defaults but does not accept it back)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        client = (type(optimizer), {k: v for k, v in optimizer.defaults.items() if k in accepted})
        # the groups and their own hyperparameters (nanoGPT's decay / no-decay)
        if model_parameters is None:
            model_parameters = [{k: v for k, v in group.items() if k == "params" or k in accepted}
                                for group in optimizer.param_groups]
            _check_optimizer_covers(model, optimizer)
    if lr_scheduler is not None and (isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
                                     or not callable(lr_scheduler)):
        raise ConfigError("lr_scheduler= must be a callable (optimizer -> scheduler), e.g. "
                          "lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f): a "
                          "scheduler built on your optimizer would change the learning rate of an "
                          "optimizer the engine does not step")
    engine = build_engine(model, config, comm, model_parameters, mesh, client_optimizer=client,
                          client_scheduler=lr_scheduler is not None)
    if lr_scheduler is not None:
        engine.lr_scheduler = lr_scheduler(engine.optimizer)
    if comm is None and mesh is None and not _in_launch_worker():
        # DeepSpeed's initialize runs init_distributed: a program may call torch.distributed after
        # it
        from minizero.comm.communicator import get, init_torch_beside
        init_torch_beside(get())
    _watch()
    loader = None if training_data is None else _loader(engine, training_data, collate_fn)
    # a pipeline: train_batch() reads it, as in
    if loader is not None and hasattr(engine, "set_dataloader"):
        # DeepSpeed's PipelineEngine (in order, repeating)
        from minizero.utils import RepeatingLoader
        engine.set_dataloader(loader := RepeatingLoader(loader))
    return Initialized(engine, engine.optimizer, loader, engine.lr_scheduler)


def _watch():
    """A job of several ranks started by hand (mpirun or torchrun running the user's script) gets
    what `minizero train` has (comm/watchdog.py): the watchdog names a rank stuck in a collective,
    and the reaper a rank killed without a word (kill -9, the OOM killer) and removes the job
    directory. Once per process; all ranks call it."""
    from minizero import comm as comm_mod
    from minizero.comm import watchdog
    world = comm_mod.get()
    if world.size > 1:
        watchdog.start(world)


def _check_optimizer_covers(model, optimizer):
    """optimizer= was built on model= (its groups are the engine's): said in its own words, not
    model_parameters'. Frozen parameters of the model (requires_grad=False) may be in the groups, as
    torch, DeepSpeed and Accelerate allow: they never get a gradient, so they are skipped
    (param_groups drops them) as torch's step skips them."""
    owned = {id(p) for p in model.parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    grouped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    foreign, missing = len(grouped - owned), len(trainable - grouped)
    if foreign or missing:
        raise ConfigError(f"optimizer= was not built on model='s parameters: its param groups hold "
                          f"{foreign} tensors that are not parameters of the model and miss "
                          f"{missing} trainable ones. Build it on this model, e.g. "
                          "torch.optim.AdamW(model.parameters(), lr=...) (every trainable "
                          "parameter in one group)")


def _config(args, config, config_params):
    if config is not None and config_params is not None and config is not config_params:
        raise ConfigError("pass the config once: config= or config_params= (DeepSpeed's older "
                          "name), not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise ConfigError("a config came twice: args.deepspeed_config and config=; pass one (as "
                          "DeepSpeed says)")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("minizero.initialize needs a config: config=\"ds_config.json\" (or a "
                          "dict), or args.deepspeed_config")
    return config


def _loader(engine, dataset, collate_fn):
    """DeepSpeed's training dataloader: this dp rank's share, micro-batches of the configured
    size."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=engine.dp_size,
                                                  rank=engine.dp_rank,
                                                  shuffle=not hasattr(engine, "set_dataloader"),
                                                  seed=engine.plan.seed)
    return torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                                       sampler=sampler, collate_fn=collate_fn, drop_last=True)
