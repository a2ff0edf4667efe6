"""The engine's front door: a config (and the model it will train) -> a checked EnginePlan, before
any rank changes anything.

    plan = resolve(config, world_size, model, model_parameters=None, node_size=None, device=cpu)

config.load_config checks the JSON alone (keys, types, values, the batch triple, the cross-key rules
of one section). resolve() adds every rule that needs the model, the device or what the engine
implements, so `initialize` and `minizero train`'s preflight raise the same ConfigError, once,
before the first collective (tests/test_engine.py runs every one of them on a communicator that
records its calls). The EnginePlan is all the engine reads: the chain it builds (runtime/engine.py)
is a function of it.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from minizero.comm.launcher import local_world_size
from minizero.runtime.config import CheckedConfig, ConfigError, load_config, load_json, warn
from minizero.runtime.schedulers import build_scheduler


class PipelineSpec(NamedTuple):
    """The pipeline section, as the pipeline engine reads it."""
    stages: int = 1              # pipeline stages (pp)
    schedule: str = "1f1b"       # gpipe, 1f1b, interleaved_1f1b or zb_h1 (pipeline/schedules.py)
    chunks: int = 1              # model chunks per rank (Megatron's virtual stages)


class EnginePlan(NamedTuple):
    """Everything the engine builds from, checked; the runtime below resolve() reads these fields
    only."""
    # the checked config, every default filled in (config.py): engine.config, nothing else
    config: dict
    world_size: int          # ranks in the job
    dp_size: int             # ranks that split the batch (world / (pp x tp x cp))
    pp_size: int             # pipeline stages
    tp_size: int             # tensor-parallel ranks
    stage: int               # the ZeRO stage
    dtype: torch.dtype       # fp32, fp16 or bf16 (the model is cast to it)
    optimizer_cls: type      # the torch optimizer, by DeepSpeed's rules (optimizer_spec)
    optimizer_kwargs: dict
    groups: list | None      # model_parameters as param groups (None: one group)
    zero_init: object        # the zero.Init recorder the model was built under, or None
    offload: object          # a zero.tiers.OffloadSpec (DeepSpeed's offload sections), or None
    cp_size: int = 1  # sequence_parallel_size: ranks splitting each sequence (DeepSpeed-Ulysses)
    ep_size: int = 1         # the model's MoE layers' ep_size: ranks sharing out the experts
    # the data-parallel strategy's knobs (zero_optimization), converted once
    # reduce_bucket_size: gradients per DDP / ZeRO-2 bucket (elements)
    bucket_numel: int = 500_000_000
    overlap_comm: bool = False  # reduce during backward; at stage 3 with prefetch: gather ahead
    prefetch: bool = False                # stage 3: gather the next unit while this one computes
    persistence_threshold: int = 100_000  # stage 3: parameters below this many elements stay whole
    zeropp: object = None  # a zero.tiers.ZeroPPSpec when a ZeRO++ key is on, else None
    # hybrid sharding: ZeRO-3 over groups of this many ranks (MiCS)
    mics_shard_size: int | None = None
    shard_layout: str = "flat"  # stage 3: "flat" units or "per_param" (FSDP2's dim-0 pieces)
    # the rest of the chain
    sequence_parallel: bool = False       # tensor_parallel.sequence_parallel (Megatron's SP)
    cp_attention: str = "ulysses"         # context_parallel.attention: ulysses or ring
    # the section is present: every block recomputes in backward
    activation_checkpointing: bool = False
    loss_scaler: dict | None = None  # fp16's LossScaler keyword arguments (fp16 enabled), else None
    gradient_clipping: float = 0.0        # the global-norm clip (0: off)
    train_batch_size: int = 1
    micro_batch_size: int = 1             # train_micro_batch_size_per_gpu
    gradient_accumulation_steps: int = 1
    scheduler: dict | None = None  # DeepSpeed's scheduler section (schedulers.build_scheduler)
    seed: int = 0                         # the data loader's shuffle seed
    pipeline: PipelineSpec = PipelineSpec()
    # a sparse.SparsityConfig (DeepSpeed's sparse_attention section), or None
    sparse_attention: object = None
    # what ZeRO 1-2 step: bf16 with bf16_master_weights_and_grads
    master_dtype: torch.dtype = torch.float32
    # DeepSpeed's accessors hand back these as the user wrote them (engine.zero_offload_optimizer(),
    # ...)
    # zero_optimization.offload_optimizer when it offloads, else None
    offload_optimizer: dict | None = None
    offload_param: dict | None = None  # zero_optimization.offload_param when it offloads, else None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False

    @property
    def mixed_precision(self) -> bool:
        """fp16 or bf16 parameters with fp32 masters."""
        return self.dtype != torch.float32


def optimizer_spec(section: dict):
    """DeepSpeed's optimizer section -> (torch optimizer class, kwargs), by DeepSpeed's rules."""
    params = dict(section.get("params", {}))
    if "max_grad_norm" in params:
        raise ConfigError("'max_grad_norm' is not an optimizer parameter (as in DeepSpeed): use "
                          "gradient_clipping")
    if section["type"] == "SGD":
        return torch.optim.SGD, params
    # DeepSpeed's keys as they are (freeze_step, cuda_aware, comm_backend_name)
    if section["type"] == "OneBitAdam":
        from minizero.compression import OneBitAdam
        return OneBitAdam, params
    # DeepSpeed: "Adam" is AdamW unless told otherwise
    adam_w_mode = params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)  # DeepSpeed's switch to torch's Adam: always torch here
    params.setdefault("weight_decay", 0.0)  # FusedAdam's default (torch's AdamW says 0.01)
    return (
        torch.optim.AdamW if section["type"] == "AdamW" or adam_w_mode else torch.optim.Adam
    ), params


def _without(cfg: dict, section: str) -> dict:
    """cfg with `section` None, leaving the caller's (maybe reused) checked config as it was."""
    out = type(cfg)(cfg)
    out.__dict__.update(getattr(cfg, "__dict__", {}))
    out[section] = None
    return out


def check_config(cfg: dict, client_optimizer=None, client_scheduler: bool = False) -> tuple:
    """The rules that need no model: the optimizer, scheduler and loss scaler built on a dummy
    tensor, and the modes the pipeline engine does not implement. -> (config, optimizer class,
    kwargs); the config loses the sections initialize()'s optimizer= / lr_scheduler= override.
    client_optimizer: (class, defaults) of an optimizer passed to initialize(optimizer=) instead of
    a section."""
    from minizero.precision import LossScaler
    # DeepSpeed's engine (_configure_optimizer, _configure_lr_scheduler) uses what initialize() was
    # given and never reads the section then ("This overrides any optimizer definition in the
    # DeepSpeed json config")
    if client_optimizer is not None and cfg["optimizer"] is not None:
        warn(f"initialize(optimizer={client_optimizer[0].__name__}) overrides the config's "
             f"'optimizer' section ({cfg['optimizer']['type']}), as in DeepSpeed: the section is "
             "not used")
        cfg = _without(cfg, "optimizer")
    if client_scheduler and cfg["scheduler"] is not None:
        warn("initialize(lr_scheduler=...) overrides the config's 'scheduler' section "
             f"({cfg['scheduler']['type']}), as in DeepSpeed: the section is not used")
        cfg = _without(cfg, "scheduler")
    if client_optimizer is None and cfg["optimizer"] is None:
        raise ConfigError("the engine needs an 'optimizer' section, "
                          "e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}, or "
                          "initialize(optimizer=...)")
    cls, kw = client_optimizer if client_optimizer is not None else optimizer_spec(cfg["optimizer"])
    if _is_onebit(cls):
        _check_onebit(cfg)
    if cfg["zero_optimization"]["stage"] > 0:
        from minizero.zero.flat_shard_optimizer import check_optimizer_class
        try:
            check_optimizer_class(cls)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    try:
        dummy = [torch.zeros(1, requires_grad=True)]
        build_scheduler(cls(dummy, None, **kw) if _is_onebit(cls) else cls(dummy, **kw),
                        cfg["scheduler"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer/scheduler params: {e}") from None
    # the loss scaler's own checks, on a throwaway one: before the model is cast
    if cfg["fp16"]["enabled"]:
        try:
            LossScaler(**{k: v for k, v in cfg["fp16"].items() if k != "enabled"})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"fp16: {e}") from None
    if cfg["tensor_parallel"]["sequence_parallel"] and cfg["tensor_parallel"]["autotp_size"] == 1:
        raise ConfigError("tensor_parallel.sequence_parallel needs tensor_parallel.autotp_size > 1")
    if cfg["pipeline"]["stages"] > 1:
        _check_pipeline_modes(cfg)
    return cfg, cls, kw


def _is_onebit(cls) -> bool:
    from minizero.compression import OneBitAdam
    return isinstance(cls, type) and issubclass(cls, OneBitAdam)


def _check_onebit(cfg: dict):
    """1-bit Adam (compression/onebit_adam.py) where DeepSpeed and minizero run it: ZeRO stage 0
    (DeepSpeed asserts it in engine.py's _configure_basic_optimizer), fp32, one data-parallel
    group."""
    for what, on in (("zero_optimization.stage > 0", cfg["zero_optimization"]["stage"] > 0),
                     ("fp16", cfg["fp16"]["enabled"]), ("bf16", cfg["bf16"]["enabled"]),
                     ("pipeline.stages > 1", cfg["pipeline"]["stages"] > 1),
                     ("tensor_parallel.autotp_size > 1", cfg["tensor_parallel"]["autotp_size"] > 1),
                     ("sequence_parallel_size > 1", cfg["sequence_parallel_size"] > 1)):
        if on:
            raise ConfigError(f"optimizer.type 'OneBitAdam' with {what}: not available. 1-bit Adam "
                              "runs at ZeRO stage 0 (as in DeepSpeed), in fp32, over one "
                              "data-parallel group; remove one")


def _check_pipeline_modes(cfg: dict):
    for section in ("fp16", "bf16"):
        if cfg[section]["enabled"]:
            raise ConfigError(f"{section} with pipeline.stages > 1: not available; the pipeline "
                              f"runs in fp32 (set {section}.enabled false, or pipeline.stages 1)")
    if cfg["tensor_parallel"]["sequence_parallel"]:
        raise ConfigError("tensor_parallel.sequence_parallel with pipeline.stages > 1: not "
                          "implemented (the pipes carry the whole sequence between stages); set "
                          "sequence_parallel false or stages 1")
    zero = cfg["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        if zero[section]["device"] != "none":
            raise ConfigError(f"zero_optimization.{section}.device {zero[section]['device']!r} "
                              "with pipeline.stages > 1: not available; the pipeline engine keeps "
                              f"each stage's optimizer on the device (set {section}.device 'none', "
                              "or pipeline.stages 1)")


def _check_tensor_parallel(model, cfg: dict):
    """TP needs a nanoGPT-named model built normally, no offload, and no SP under ZeRO-3."""
    tp = cfg["tensor_parallel"]
    if tp["autotp_size"] == 1:
        return
    missing = [n for n in ("wte", "wpe", "h", "ln_f", "lm_head") if not hasattr(model, n)]
    if missing:
        raise ConfigError(f"tensor_parallel.autotp_size={tp['autotp_size']} splits a nanoGPT-named "
                          "model (wte, wpe, h.{i}.attn/mlp, ln_f, lm_head, as "
                          f"minizero.models.TinyGPT); {type(model).__name__} has no "
                          f"{', '.join(missing)}")
    zero = cfg["zero_optimization"]
    offloaded = [k for k in ("offload_optimizer", "offload_param") if zero[k]["device"] != "none"]
    if offloaded:  # the host optimizer's gradients and norm weights are not split-aware
        raise ConfigError(f"tensor_parallel.autotp_size={tp['autotp_size']} with zero_optimization."
                          f"{offloaded[0]}: offload with tensor parallelism is not implemented; "
                          f"set autotp_size 1 or the offload device to none")
    from minizero.zero.init import built_with_init
    # TensorParallelGPT slices real weights, not meta tensors
    if built_with_init(model) is not None:
        raise ConfigError(f"tensor_parallel.autotp_size={tp['autotp_size']} with a model built "
                          "under zero.Init: tensor parallelism slices the built weights; build the "
                          "model normally")
    if tp["sequence_parallel"] and zero["stage"] == 3:
        raise ConfigError("tensor_parallel.sequence_parallel with zero_optimization.stage 3: FSDP "
                          "replaces the parameters by flat shards, so the hooks that sum the "
                          "LayerNorm gradients over the tp group would be lost. Use stage 0, 1 or "
                          "2 with sequence parallelism, or turn it off")
    from minizero.tensor import TensorParallelGPT
    try:
        # heads, hidden, vocabulary divisible by t
        TensorParallelGPT.check(model, tp["autotp_size"])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_sequence_parallel(model, cfg: dict):
    """sequence_parallel_size cp > 1 (DeepSpeed-Ulysses): a model with the hook, heads and length
    divisible."""
    cp = cfg["sequence_parallel_size"]
    if cp == 1:
        return
    for key, on in (("pipeline.stages > 1", cfg["pipeline"]["stages"] > 1),
                    ("tensor_parallel.autotp_size > 1", cfg["tensor_parallel"]["autotp_size"] > 1)):
        if on:
            raise ConfigError(f"sequence_parallel_size={cp} with {key}: not implemented in "
                              "minizero's engine (the mechanisms compose: tests/test_context.py "
                              "runs dp x cp x tp); use one of them")
    zero = cfg["zero_optimization"]
    if (
        zero["zero_quantized_weights"]
        or zero["zero_quantized_gradients"]
        or zero["zero_hpz_partition_size"] > 1
    ):
        raise ConfigError(f"sequence_parallel_size={cp} with ZeRO++: not implemented (ZeroPP's "
                          "nodes are cut from the whole world); turn ZeRO++ off or set "
                          "sequence_parallel_size 1")
    if not hasattr(model, "set_context_parallel"):
        raise ConfigError(f"sequence_parallel_size={cp} needs a model that takes the "
                          "context-parallel group: set_context_parallel(comm), then whole "
                          "sequences in forward (minizero.models.TinyGPT has it); "
                          f"{type(model).__name__} has none")
    gpt, ring = model.config, cfg["context_parallel"]["attention"] == "ring"
    if gpt.n_head % cp and not ring:
        raise ConfigError(f"sequence_parallel_size={cp}: Ulysses gives each of the {cp} ranks "
                          f"n_head/cp whole heads, but the model has {gpt.n_head} heads; use a "
                          f"sequence_parallel_size that divides {gpt.n_head}, or "
                          "context_parallel.attention 'ring'")
    parts = 2 * cp if ring else cp
    if gpt.block_size % parts:
        what = (
            f"two chunks of seq_len/{parts} (ring attention's load balancing)"
            if ring
            else f"seq_len/{cp} tokens"
        )
        raise ConfigError(f"sequence_parallel_size={cp}: each rank keeps {what}, and block_size "
                          f"{gpt.block_size} is not divisible by {parts}")


def moe_layers(model) -> list:
    """The model's minizero.moe.MoE layers (DeepSpeed's deepspeed.moe.layer.MoE)."""
    from minizero.moe import MoE
    return [m for m in model.modules() if isinstance(m, MoE)]


def _expert_parallel_size(model, cfg: dict, world_size: int) -> int:
    """The ep_size of the model's MoE layers (1 without), checked against the config."""
    from minizero.moe import MoELayer
    split = [n for n,
             m in model.named_modules() if isinstance(m, MoELayer) and m.ep_comm is not None]
    if split:
        raise ConfigError(f"{split[0]} already runs over an expert-parallel group: the engine "
                          "splits the experts itself; build the model with minizero.moe.MoE(..., "
                          "ep_size=N) and no group")
    layers = moe_layers(model)
    if not layers:
        return 1
    sizes = sorted({m.ep_size for m in layers})
    if len(sizes) > 1:
        raise ConfigError(f"the model's MoE layers have different ep_size {sizes}: minizero's "
                          "engine builds one expert-parallel group; give every layer the same "
                          "ep_size")
    ep, zero = sizes[0], cfg["zero_optimization"]
    for key, on in (("pipeline.stages > 1", cfg["pipeline"]["stages"] > 1),
                    ("tensor_parallel.autotp_size > 1", cfg["tensor_parallel"]["autotp_size"] > 1),
                    ("sequence_parallel_size > 1", cfg["sequence_parallel_size"] > 1),
                    (f"zero_optimization.stage {zero['stage']}", ep > 1 and zero["stage"] > 1),
                    ("offload_optimizer",
                     ep > 1 and zero["offload_optimizer"]["device"] != "none")):
        if on:
            raise ConfigError(f"a model with MoE layers (ep_size={ep}) with {key}: not implemented "
                              "in minizero's engine, which runs MoE layers without pipeline, "
                              "tensor or sequence parallelism and reduces expert parameters over "
                              "expert_dp (ep_size > 1) at ZeRO stages 0 and 1, without offload "
                              "(DeepSpeed-MoE also takes ZeRO-2)")
    dp = world_size // (cfg["pipeline"]["stages"] * cfg["tensor_parallel"]["autotp_size"]
                        * cfg["sequence_parallel_size"])
    if dp % ep:
        raise ConfigError(f"the MoE layers' ep_size={ep} does not divide the {dp} data-parallel "
                          "ranks: experts are shared out over slices of ep consecutive ranks; "
                          f"launch a multiple of {ep} ranks")
    return ep


def _pipeline_stages(config, model):
    """A deepspeed.pipe.PipelineModule says its stage count (num_stages), as in DeepSpeed, whose
    config has no pipeline.stages to give: it becomes the config's, before the batch arithmetic that
    depends on it."""
    # Asked, not imported: minizero.pipe sits above the engine and imports its ConfigError
    stages = getattr(model, "num_stages", None)
    if not (hasattr(model, "pipeline_parts") and isinstance(stages, int)):
        return config
    if isinstance(config, CheckedConfig):
        if config["pipeline"]["stages"] != model.num_stages:
            raise ConfigError("this config was checked for pipeline.stages = "
                              f"{config['pipeline']['stages']} but the PipelineModule has "
                              f"num_stages={model.num_stages}: pass the config as a dict or a path")
        return config
    config = copy.deepcopy(load_json(config))  # a copy: the caller's dict stays as it was
    if not isinstance(config, dict) or not isinstance(config.get("pipeline", {}), dict):
        return config  # load_config says what is wrong with it
    given = config.get("pipeline", {}).get("stages")
    if given is not None and given != model.num_stages:
        raise ConfigError(f"pipeline.stages = {given!r} but the PipelineModule was built with "
                          f"num_stages={model.num_stages}: give one number (DeepSpeed reads "
                          "num_stages; leave pipeline.stages out)")
    config.setdefault("pipeline", {})["stages"] = model.num_stages
    return config


def pipeline_parts(model):
    """The model cut for a pipeline: a PipelineModel, or what model.pipeline_parts() gives
    (TinyGPT)."""
    from minizero.pipeline import PipelineModel
    if isinstance(model, PipelineModel):
        return model
    if hasattr(model, "pipeline_parts"):
        return model.pipeline_parts()
    raise ConfigError("pipeline.stages > 1 needs a model cut into stages: a "
                      "minizero.pipeline.PipelineModel (embed, blocks, head, loss_fn, "
                      "hidden_shape) or a model with pipeline_parts() (TinyGPT has one); got a "
                      f"{type(model).__name__}")


def _check_pipeline_model(model, cfg: dict):
    from minizero.pipeline.stage import PipelineError, partition
    pipe = cfg["pipeline"]
    if cfg["tensor_parallel"]["autotp_size"] > 1:
        blocks = list(model.h)
    else:
        parts = pipeline_parts(model)
        blocks = parts.blocks
        if getattr(parts, "stage_blocks", None) is not None:
            return  # cut already, as DeepSpeed's PipelineModule cuts its layers (pipe.py)
    try:
        # more stages than blocks, uneven chunks
        partition(len(blocks), pipe["stages"], pipe["chunks"])
    except (PipelineError, ValueError) as e:
        raise ConfigError(f"pipeline: {e}") from None
    sizes = {sum(p.numel() for p in b.parameters()) for b in blocks}
    if pipe["partition"] == "parameters" and len(sizes) > 1:
        raise ConfigError(f"pipeline.partition 'parameters': the blocks hold {sorted(sizes)} "
                          "parameters; minizero cuts by block count, which balances parameters "
                          "only for equal blocks: use 'uniform'")


def resolve(
    config,
    world_size: int,
    model=None,
    model_parameters=None,
    node_size: int | None = None,
    device=None,
    client_optimizer=None,
    client_scheduler: bool = False,
) -> EnginePlan:
    """Every check, in one place, touching nothing (module docstring). model None: the config's
    rules only. device: a function giving the ranks' device, called only by a rule that needs it.
    client_optimizer / client_scheduler: what initialize(optimizer=, lr_scheduler=) brought instead
    of config sections."""
    cfg = load_config(_pipeline_stages(config, model), world_size)
    cfg, cls, kw = check_config(cfg, client_optimizer, client_scheduler)
    zero, pipe, tp = (
        cfg["zero_optimization"],
        cfg["pipeline"],
        cfg["tensor_parallel"]["autotp_size"],
    )
    hpz = zero["zero_hpz_partition_size"]
    if node_size is not None and hpz > 1 and hpz != node_size:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={hpz} but the mesh has nodes "
                          f"of {node_size} ranks: hpZ's groups are the mesh's nodes; make them "
                          "agree")
    # ranks the launcher put on this node (environment only: no collective)
    local = local_world_size()
    if node_size is None and hpz > 1 and local is not None and local < world_size and hpz != local:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={hpz} but the launcher put "
                          f"{local} ranks on each node: hpZ's secondary partition is one node's "
                          "ranks (its backward all-gather must stay inside a node, and its bytes "
                          f"are booked by the real nodes); set it to {local}")
    offload = None
    # DeepSpeed's sections -> what the strategy's tier is built from
    if zero["offload_optimizer"]["device"] != "none":
        from minizero.zero.tiers import OffloadSpec
        opt, param, aio = zero["offload_optimizer"], zero["offload_param"], cfg["aio"]
        offload = OffloadSpec(device=opt["device"], pin_memory=opt["pin_memory"],
                              dpu_warmup_steps=opt["dpu_warmup_steps"],
                              nvme_path=opt["nvme_path"],
                              sub_group_numel=int(zero["sub_group_size"]),
                              prefetch=aio["overlap_events"], io_threads=aio["thread_count"],
                              params=param["device"], param_nvme_path=param["nvme_path"])
        where = (
            device() if zero["offload_param"]["device"] != "none" and device is not None else None
        )
        if where is not None and where.type != "cpu":
            raise ConfigError("offload_param is implemented for CPU runs only (where the host "
                              "shard and its device copy are both host memory); on CUDA remove "
                              "offload_param, keep offload_optimizer")
    groups, zero_init, ep, cp = None, None, 1, cfg["sequence_parallel_size"]
    if model is None and cp > 1 and (pipe["stages"] > 1 or tp > 1):
        _check_sequence_parallel(None, cfg)  # the rules that need no model
    if model is not None:
        if cfg["activation_checkpointing"] is not None and pipe["stages"] == 1:
            from minizero.activation_checkpointing import repeated_blocks
            # the engine checkpoints every element of every nn.ModuleList
            if not repeated_blocks(model):
                raise ConfigError(f"activation_checkpointing: {type(model).__name__} has no "
                                  "nn.ModuleList of blocks to checkpoint: remove the section, or "
                                  "call minizero.activation_checkpointing.checkpoint_blocks(model, "
                                  "['layer1', ...]) yourself")
        # first: TP's own checks do not know MoE blocks
        ep = _expert_parallel_size(model, cfg, world_size)
        _check_tensor_parallel(model, cfg)
        _check_sequence_parallel(model, cfg)
        if pipe["stages"] > 1:
            _check_pipeline_model(model, cfg)
        if model_parameters is not None:
            from minizero.zero.flat_shard_optimizer import covering_param_groups
            try:
                groups = covering_param_groups(model, model_parameters, "model_parameters")
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
        if groups and ep > 1 and zero["stage"] == 1:
            raise ConfigError(f"model_parameters with MoE layers of ep_size={ep} at "
                              "zero_optimization.stage 1 is not implemented: the dense and the "
                              "expert parameters get one ZeRO-1 optimizer each, of one group; "
                              "leave model_parameters out, or use stage 0")
        if groups and len(groups) > 1 and offload is not None and offload.device == "nvme":
            raise ConfigError(f"model_parameters has {len(groups)} param groups, but "
                              "offload_optimizer nvme steps its sub-groups as ONE group: pass one "
                              "group (its lr/weight_decay apply), or offload to device cpu "
                              "(several groups work there)")
        for key, on in (("tensor_parallel.autotp_size", tp > 1),
                        ("pipeline.stages", pipe["stages"] > 1)):
            if groups and on and len(groups) == 1 and set(groups[0]) == {"params"}:
                # every trainable parameter, no hyperparameter of its own: the default group
                groups = None
            if groups and on:
                raise ConfigError(f"model_parameters with {key} > 1 is not implemented: the split "
                                  "replaces the model's parameters by their slices (or a stage's), "
                                  "so groups of the originals would train nothing; leave "
                                  f"model_parameters out (one group) or set {key} 1")
        from minizero.zero.init import built_with_init
        zero_init = built_with_init(model)
        if zero_init is not None and zero["stage"] != 3:
            raise ConfigError("a model built under zero.Init needs ZeRO stage 3, got stage "
                              f"{zero['stage']}")
        if cfg["zero_init"] and zero_init is None:
            raise ConfigError("zero_init: true, but the model was built without zero.Init: build "
                              "it inside `with minizero.zero.Init(): model = ...` (python -m "
                              "minizero train does), or remove the key")
    sparse = _sparse_attention(model, cfg) if model is not None else None
    mics = zero["mics_shard_size"] if zero["mics_shard_size"] > 0 else None
    if mics is not None:
        _check_hybrid(mics, cfg, world_size, ep, zero_init)
    dtype = (
        torch.float16
        if cfg["fp16"]["enabled"]
        else torch.bfloat16
        if cfg["bf16"]["enabled"]
        else torch.float32
    )
    from minizero.zero.tiers import ZeroPPSpec
    zeropp = ZeroPPSpec(zero["zero_quantized_weights"], hpz, zero["zero_quantized_gradients"])
    if cfg["bf16"]["bf16_master_weights_and_grads"] and ep > 1:
        raise ConfigError("bf16.bf16_master_weights_and_grads with MoE layers of ep_size > 1 is "
                          "not implemented: the expert strategy keeps fp32 masters; remove the key "
                          "or use ep_size 1")
    return EnginePlan(
        cfg, world_size, world_size // (pipe["stages"] * tp * cp), pipe["stages"], tp,
        zero["stage"], dtype, cls, kw, groups, zero_init, offload, cp, ep,
        bucket_numel=int(zero["reduce_bucket_size"]), overlap_comm=zero["overlap_comm"],
        prefetch=zero["overlap_comm"] and zero["stage3_prefetch_bucket_size"] > 0,
        persistence_threshold=int(zero["stage3_param_persistence_threshold"]),
        zeropp=zeropp if zeropp.enabled else None, mics_shard_size=mics,
        shard_layout=zero["shard_layout"],
        sequence_parallel=cfg["tensor_parallel"]["sequence_parallel"],
        cp_attention=cfg["context_parallel"]["attention"],
        activation_checkpointing=cfg["activation_checkpointing"] is not None,
        loss_scaler=({k: v for k, v in cfg["fp16"].items() if k != "enabled"}
                     if cfg["fp16"]["enabled"] else None),
        gradient_clipping=cfg["gradient_clipping"], train_batch_size=cfg["train_batch_size"],
        micro_batch_size=cfg["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"], scheduler=cfg["scheduler"],
        seed=cfg["seed"], pipeline=PipelineSpec(pipe["stages"], pipe["schedule"], pipe["chunks"]),
        sparse_attention=sparse,
        master_dtype=(torch.bfloat16 if cfg["bf16"]["bf16_master_weights_and_grads"]
                      else torch.float32),
        offload_optimizer=zero["offload_optimizer"] if offload is not None else None,
        offload_param=(zero["offload_param"] if offload is not None and offload.params != "none"
                       else None),
        steps_per_print=cfg["steps_per_print"],
        wall_clock_breakdown=bool(cfg["wall_clock_breakdown"]))


def _sparse_attention(model, cfg: dict):
    """DeepSpeed's sparse_attention section -> a sparse.SparsityConfig for the model's heads
    (checked here, once)."""
    section = cfg["sparse_attention"]
    if section is None:
        return None
    if cfg["sequence_parallel_size"] > 1:
        raise ConfigError("sparse_attention with "
                          f"sequence_parallel_size={cfg['sequence_parallel_size']}: not "
                          "implemented (context parallelism runs its own attention over the cp "
                          "group); use one")
    heads = getattr(getattr(model, "config", None), "n_head", None)
    if heads is None or not any(hasattr(m, "sparse_attention") for m in model.modules()):
        raise ConfigError(f"sparse_attention: {type(model).__name__} has no attention module that "
                          "takes a layout (minizero.models.TinyGPT's does); remove the section")
    from minizero.sparse import from_section
    try:
        config = from_section(section, heads)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sparse_attention: {e}".replace("sparse_attention: sparse_attention:",
                                                           "sparse_attention:")) from None
    if not config.causal:
        raise ConfigError("sparse_attention.attention must be \"unidirectional\" for a causal "
                          f"model like {type(model).__name__} (DeepSpeed's default, bidirectional, "
                          "lets tokens see the future)")
    return config


def _check_hybrid(k: int, cfg: dict, world_size: int, ep: int, zero_init):
    """zero_optimization.mics_shard_size k (DeepSpeed's MiCS): ZeRO-3 over groups of k ranks,
    replicated across them."""
    zero = cfg["zero_optimization"]
    key = f"zero_optimization.mics_shard_size={k}"
    if zero["stage"] != 3:
        raise ConfigError(f"{key} shards parameters over groups of {k} ranks, which needs stage 3 "
                          f"(as DeepSpeed's MiCS); got stage {zero['stage']}. Set \"stage\": 3 or "
                          "remove it")
    if world_size % k:
        raise ConfigError(f"{key} does not divide the world size {world_size}: the shard groups "
                          f"must tile the ranks; use a divisor of {world_size}")
    others = [
        (what, on)
        for what, on in (
            (
                "ZeRO++ (zero_quantized_weights / zero_hpz_partition_size / "
                "zero_quantized_gradients)",
                zero["zero_quantized_weights"]
                or zero["zero_quantized_gradients"]
                or zero["zero_hpz_partition_size"] > 1,
            ),
            ("offload_optimizer", zero["offload_optimizer"]["device"] != "none"),
            ("pipeline.stages > 1", cfg["pipeline"]["stages"] > 1),
            ("tensor_parallel.autotp_size > 1", cfg["tensor_parallel"]["autotp_size"] > 1),
            ("sequence_parallel_size > 1", cfg["sequence_parallel_size"] > 1),
            (f"MoE layers of ep_size={ep}", ep > 1),
            ("a model built under zero.Init", zero_init is not None),
        )
        if on
    ]
    if others:
        raise ConfigError(f"{key} with {others[0][0]}: not implemented in minizero "
                          "(zero.HybridShard shards over the ranks of one group and averages "
                          "across groups, with none of these); remove one")
