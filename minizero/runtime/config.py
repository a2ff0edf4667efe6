"""minizero.runtime.config: the DeepSpeed JSON subset minizero understands, validated.

A student's ds_config.json should mean the same thing here and in DeepSpeed, so:
  * every key minizero implements has DeepSpeed's name, default and meaning;
  * a real DeepSpeed key that minizero does not implement is an error that names it and
    says what to do (never silently ignored: a config that "works" but ignores half its
    settings teaches the wrong thing);
  * an unknown key (a typo) is an error listing the valid keys at that level;
  * "auto" resolves to the documented default (AUTO_DEFAULTS below);
  * the batch triple is derived and checked the way DeepSpeed does it.

`load_config(path_or_dict, world_size) -> dict` returns a complete, validated config with
every default filled in, so the engine reads values without `.get(..., default)` guesses.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
import warnings

# Every key minizero implements, with its default. Nested dicts are sections.
# `REQUIRED` marks keys without a default.
REQUIRED = object()
SCHEMA = {
    "train_batch_size": None,                 # derived from the other two when absent
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "gradient_clipping": 1.0,                 # max global L2 norm (across shards); 0 = off. DeepSpeed 0.19's default is 1.0
    "steps_per_print": 10,
    "wall_clock_breakdown": False,            # per-step forward/backward/step times in the log
    "seed": 0,                                # minizero extra: model init and data order
    "optimizer": {
        "type": REQUIRED,                     # Adam, AdamW or SGD
        "params": {},
    },
    "scheduler": {
        "type": REQUIRED,                     # WarmupLR, WarmupDecayLR, WarmupCosineLR
        "params": {},
    },
    "fp16": {
        "enabled": False,
        "loss_scale": 0,                      # 0 = dynamic; > 0 = static scale
        "initial_scale_power": 16,            # dynamic scale starts at 2**power
        "loss_scale_window": 1000,            # good steps before the scale doubles
        "hysteresis": 2,                      # overflows tolerated before the scale halves
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 0,
        "overlap_comm": None,                 # None -> True for stage 3, False otherwise (DeepSpeed)
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,            # elements, as in DeepSpeed
        "allgather_bucket_size": 5e8,
        "reduce_scatter": True,
        "allgather_partitions": True,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": False,
        "sub_group_size": 1e9,
        # ZeRO-Offload / ZeRO-Infinity (zero/offload.py, zero/infinity.py): device none, cpu or nvme
        "offload_optimizer": {"device": "none", "nvme_path": None, "pin_memory": False,
                              "buffer_count": 4, "fast_init": False, "ratio": 1.0,
                              # minizero's extension (not in DeepSpeed's master): the paper's one-step
                              # delayed parameter update, after this many plain steps; null = off
                              "dpu_warmup_steps": None},
        "offload_param": {"device": "none", "nvme_path": None, "pin_memory": False,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "zero_quantized_weights": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_gradients": False,
    },
    # DeepSpeed's async I/O for nvme offload; here plain files through a thread pool
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True, "use_gds": False},
    "pipeline": {"stages": 1, "partition": "parameters", "micro_batches": None},
    "tensor_parallel": {"autotp_size": 1},
}

# "auto" means "pick the documented default". Keys whose auto value depends on the model
# (DeepSpeed's HF integration fills them from hidden_size) use the stated fixed default here.
AUTO_DEFAULTS = {
    "train_batch_size": None,                 # None: derived from the other two
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": 5e8,
    "zero_optimization.stage3_prefetch_bucket_size": 5e7,
    "zero_optimization.stage3_param_persistence_threshold": 1e5,
    "gradient_clipping": 1.0,
}

# Real DeepSpeed keys minizero does not implement (yet). Each maps to what to do instead.
NOT_IMPLEMENTED = {
    "activation_checkpointing": "use torch.utils.checkpoint in your model (lesson 00 measures what it saves)",
    "flops_profiler": "use torch.profiler",
    "tensorboard": "read the JSON-lines log that `minizero train` writes",
    "wandb": "read the JSON-lines log that `minizero train` writes",
    "csv_monitor": "read the JSON-lines log that `minizero train` writes",
    "comms_logger": "engine.comm_stats() returns the bytes per collective",
    "autotuning": "use `python -m minizero plan` to size a run",
    "elasticity": "not part of this course",
    "amp": "use the fp16 or bf16 sections",
    "compression_training": "not part of this course",
    "data_efficiency": "not part of this course",
    "curriculum_learning": "not part of this course",
    "sparse_attention": "not part of this course",
    "sparse_gradients": "not part of this course",
    "communication_data_type": "remove it: gradients are communicated in the training dtype",
    "prescale_gradients": "remove it: minizero averages after the reduction",
    "gradient_predivide_factor": "remove it: minizero averages after the reduction",
    "zero_allow_untested_optimizer": "remove it: any elementwise torch optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "remove it",
    "checkpoint": "use engine.save_checkpoint / load_checkpoint arguments",
    "data_types": "remove it",
    "torch_autocast": "use the fp16 or bf16 sections",
    "dump_state": "remove it",
    "memory_breakdown": "engine.memory() returns the ledger",
    "zero_optimization.round_robin_gradients": "remove it (an ordering optimization for offload)",
    "zero_optimization.load_from_fp32_weights": "remove it: checkpoints always hold fp32 masters",
    "zero_optimization.elastic_checkpoint": "remove it",
    "zero_optimization.ignore_unused_parameters": "remove it: unused parameters are always handled",
    "zero_optimization.legacy_stage1": "remove it",
    "zero_optimization.mics_shard_size": "remove it: MiCS is not part of this course",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "renamed in DeepSpeed: use stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.offload_optimizer.pipeline_read": "remove it",
    "zero_optimization.offload_optimizer.pipeline_write": "remove it",
    "fp16.auto_cast": "remove it: inputs are cast by the engine",
    "bf16.immediate_grad_update": "remove it",
}

# Keys that look like DeepSpeed's but are not (seen in the wild; seed 001 uses the first).
NOT_DEEPSPEED = {
    "zero_optimization.offload_gradients": "DeepSpeed has no such key: with offload_optimizer set, "
                                           "ZeRO-Offload already keeps the fp32 gradients on the CPU",
}

# Real DeepSpeed keys minizero accepts (so DeepSpeed configs load) but that change nothing here.
# Setting one to a non-default value warns, naming it and saying why, instead of passing silently.
NO_EFFECT = {
    "zero_optimization.offload_optimizer.buffer_count": "the disk tier keeps one sub-group reading, one stepping",
    "zero_optimization.offload_optimizer.fast_init": "the disk tier always writes the initial state once",
    "zero_optimization.offload_param.buffer_count": "offload_param keeps the shards on the host, not on disk",
    "zero_optimization.offload_param.buffer_size": "offload_param keeps the shards on the host, not on disk",
    "zero_optimization.offload_param.max_in_cpu": "offload_param keeps the shards on the host, not on disk",
    "aio.block_size": "files are read and written whole per sub-group (numpy fromfile/tofile)",
    "aio.queue_depth": "files are read and written whole per sub-group (numpy fromfile/tofile)",
    "aio.single_submit": "files are read and written whole per sub-group (numpy fromfile/tofile)",
    "aio.use_gds": "no GPUDirect Storage here: files go through host memory",
    "zero_optimization.stage3_max_live_parameters": "FSDP never holds more than one unit plus one prefetched",
    "zero_optimization.stage3_max_reuse_distance": "FSDP frees every unit after use",
    "zero_optimization.allgather_bucket_size": "ZeRO-1/2 all-gather the whole flat buffer in one call",
    "zero_optimization.contiguous_gradients": "gradients always live in contiguous flat buffers here",
    "zero_optimization.reduce_scatter": "minizero always reduce-scatters (or reduces to owners)",
    "zero_optimization.allgather_partitions": "minizero always all-gathers the partitions",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "checkpoints hold fp32 masters; `python -m minizero consolidate` writes the full weights",
}


class ConfigWarning(UserWarning):
    pass


OPTIMIZERS = ("Adam", "AdamW", "SGD")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class ConfigError(ValueError):
    pass


def _check_keys(given: dict, schema: dict, where: str, out: dict):
    for key, value in given.items():
        path = f"{where}.{key}" if where else key
        if path in NOT_IMPLEMENTED or (not where and key in NOT_IMPLEMENTED):
            raise ConfigError(f"'{path}' is a DeepSpeed key minizero does not implement: "
                              f"{NOT_IMPLEMENTED[path]}.")
        if path in NOT_DEEPSPEED:
            raise ConfigError(f"unknown config key '{path}': {NOT_DEEPSPEED[path]}. Remove it.")
        if key not in schema:
            near = difflib.get_close_matches(key, schema, n=3)
            hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            raise ConfigError(f"unknown config key '{path}'.{hint} Valid keys"
                              f"{' in ' + where if where else ''}: {', '.join(sorted(schema))}.")
        default = schema[key]
        if isinstance(default, dict) and key != "params":
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' must be a JSON object, got {value!r}")
            _check_keys(value, default, path, out.setdefault(key, {}))
        else:
            if value == "auto":
                if path not in AUTO_DEFAULTS:
                    raise ConfigError(f"'{path}' does not accept \"auto\" in minizero; give a value "
                                      f"(the ones that do: {', '.join(sorted(AUTO_DEFAULTS))}).")
                value = AUTO_DEFAULTS[path]
            if path in NO_EFFECT and value != default:
                warnings.warn(f"'{path}': {value!r} has no effect in minizero: {NO_EFFECT[path]}.",
                              ConfigWarning, stacklevel=2)
            out[key] = copy.deepcopy(value)


def _fill_defaults(schema: dict, out: dict, where=""):
    for key, default in schema.items():
        path = f"{where}.{key}" if where else key
        if isinstance(default, dict) and key != "params":
            if key in ("optimizer", "scheduler") and key not in out:
                out[key] = None  # optional sections: absent means none
                continue
            _fill_defaults(default, out.setdefault(key, {}), path)
        elif key not in out:
            if default is REQUIRED:
                raise ConfigError(f"'{path}' is required when '{where}' is given")
            out[key] = copy.deepcopy(default)


def _resolve_batch(cfg: dict, world_size: int):
    """DeepSpeed's rule: give any two of (train_batch_size, micro batch, accumulation) and the
    third is derived; give all three and they must satisfy train = micro * acc * world."""
    train, micro, acc = (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"],
                         cfg["gradient_accumulation_steps"])
    for name, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                    ("gradient_accumulation_steps", acc)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if train is None and micro is None:
        raise ConfigError("give train_batch_size or train_micro_batch_size_per_gpu (or both)")
    if train is not None and micro is not None and acc is None:
        acc, rem = divmod(train, micro * world_size)
        if rem or acc == 0:
            raise ConfigError(f"train_batch_size {train} is not divisible by micro batch {micro} x "
                              f"world size {world_size}")
    elif train is not None and micro is None:
        acc = acc or 1
        micro, rem = divmod(train, acc * world_size)
        if rem or micro == 0:
            raise ConfigError(f"train_batch_size {train} is not divisible by gradient_accumulation_steps "
                              f"{acc} x world size {world_size}")
    elif train is None:
        acc = acc or 1
        train = micro * acc * world_size
    if train != micro * acc * world_size:
        raise ConfigError("Check batch related parameters. train_batch_size is not equal to "
                          f"micro_batch_per_gpu * gradient_acc_step * world_size {train} != "
                          f"{micro} * {acc} * {world_size}")
    cfg.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=acc)


def load_config(config, world_size: int = 1) -> dict:
    """A dict or a JSON path -> a complete, validated config (see module docstring)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    cfg: dict = {}
    _check_keys(config, SCHEMA, "", cfg)
    _fill_defaults(SCHEMA, cfg)
    _resolve_batch(cfg, world_size)
    if cfg["optimizer"] is not None and cfg["optimizer"]["type"] not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type {cfg['optimizer']['type']!r} is not one of {', '.join(OPTIMIZERS)}")
    if cfg["scheduler"] is not None and cfg["scheduler"]["type"] not in SCHEDULERS:
        raise ConfigError(f"scheduler.type {cfg['scheduler']['type']!r} is not one of {', '.join(SCHEDULERS)}")
    zero = cfg["zero_optimization"]
    if zero["stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
    if zero["overlap_comm"] is None:
        zero["overlap_comm"] = zero["stage"] == 3
    if cfg["fp16"]["enabled"] and cfg["bf16"]["enabled"]:
        raise ConfigError("fp16 and bf16 are both enabled; choose one")
    if cfg["pipeline"]["stages"] > 1 and zero["stage"] >= 2:
        raise ConfigError(f"ZeRO stage {zero['stage']} cannot be combined with pipeline parallelism "
                          f"(gradients/parameters sharded across the micro-batches of a pipeline would be "
                          f"re-gathered every micro-batch); use stage 0 or 1 with pipeline.stages > 1")
    for section in ("offload_optimizer", "offload_param"):
        dev = zero[section]["device"]
        if dev not in ("none", "cpu", "nvme"):
            raise ConfigError(f"zero_optimization.{section}.device must be none, cpu or nvme, got {dev!r}")
        if dev == "nvme" and not zero[section]["nvme_path"]:
            raise ConfigError(f"zero_optimization.{section}.device is nvme but nvme_path is not set")
    if zero["offload_param"]["device"] != "none" and zero["stage"] != 3:
        raise ConfigError("zero_optimization.offload_param needs stage 3 (only stage 3 partitions parameters)")
    _check_offload(zero)
    return cfg


def _check_offload(zero: dict):
    """The offload combinations DeepSpeed refuses, and the ones minizero does not implement."""
    opt, param = zero["offload_optimizer"], zero["offload_param"]
    where = "zero_optimization.offload_optimizer"
    if opt["device"] != "none" and zero["stage"] == 0:
        raise ConfigError(f"{where}.device={opt['device']!r} needs ZeRO stage 1, 2 or 3: stage 0 keeps every "
                          "state replicated, there is no shard to offload (ZeRO-Offload builds on stage 2)")
    if opt["device"] == "nvme" and zero["stage"] != 3:
        raise ConfigError(f"{where}.device='nvme' (ZeRO-Infinity) needs stage 3, as in DeepSpeed; use device 'cpu' "
                          f"at stage {zero['stage']}")
    if param["device"] == "nvme":
        raise ConfigError("zero_optimization.offload_param.device='nvme' is not implemented in minizero: use 'cpu' "
                          "for the parameter shards (the optimizer state can go to nvme)")
    if param["device"] != "none" and opt["device"] == "none":
        raise ConfigError("zero_optimization.offload_param without offload_optimizer: offload the optimizer "
                          "state first (it is 12 of the 16 bytes per parameter)")
    if opt["ratio"] != 1.0:
        raise ConfigError(f"{where}.ratio={opt['ratio']}: partial offload is not implemented; remove it (1.0)")
    dpu = opt["dpu_warmup_steps"]
    if dpu is not None:
        if isinstance(dpu, bool) or not isinstance(dpu, int) or dpu < 0:
            raise ConfigError(f"{where}.dpu_warmup_steps must be null (off) or an integer >= 0, got {dpu!r}")
        if opt["device"] != "cpu":
            raise ConfigError(f"{where}.dpu_warmup_steps (the delayed parameter update) needs device 'cpu', "
                              f"got {opt['device']!r}")
    if zero["sub_group_size"] != SCHEMA["zero_optimization"]["sub_group_size"] and opt["device"] != "nvme":
        warnings.warn(f"'zero_optimization.sub_group_size': {zero['sub_group_size']!r} has an effect only with "
                      "offload_optimizer.device 'nvme' (the disk tier's piece); elsewhere minizero steps each rank's "
                      "shard as one group", ConfigWarning, stacklevel=3)
    for section in ("offload_optimizer", "offload_param"):
        if not isinstance(zero[section]["pin_memory"], bool):
            raise ConfigError(f"zero_optimization.{section}.pin_memory must be true or false")
