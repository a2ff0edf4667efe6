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

from minizero.comm.launcher import launched_rank
from minizero.pipeline.schedules import SCHEDULES

# Every key minizero implements, with its default. Nested dicts are sections.
# `REQUIRED` marks keys without a default.
REQUIRED = object()
SCHEMA = {
    "train_batch_size": None,                 # derived from the other two when absent
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "gradient_clipping": 1.0,                 # max global L2 norm (across shards); 0 = off.
                                              # DeepSpeed 0.19's default is 1.0
    "steps_per_print": 10,
    "wall_clock_breakdown": False,            # per-step forward/backward/step times in the log
    # DeepSpeed's switch that refuses a client optimizer other than its C++ CPU Adam under
    # ZeRO-Offload. Here every offloaded optimizer is a torch optimizer stepping on the CPU
    # (ops.adam's CPU Adam is torch's), so both values run the same; read so DeepSpeed's configs
    # (which set false to use a torch optimizer) load.
    "zero_force_ds_cpu_optimizer": True,
    "seed": 0,                                # minizero extra: model init and data order
    "model": "tiny-gpt",  # minizero extra: what `minizero train` builds (a models.MODELS name)
    "zero_init": False,  # minizero extra: `minizero train` builds it under zero.Init (stage 3)
    # DeepSpeed's block-sparse attention section ({"mode": "fixed", "block": 16, ...};
    # minizero/sparse/): every attention of the model runs the layout; its keys are checked per mode
    # by sparse.from_section (resolve.py)
    "sparse_attention": None,
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
    "bf16": {
        "enabled": False,
        # ZeRO 1-2: the optimizer steps the bf16 shard itself
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": False,           # with it: the optimizer's state in bf16 too
    },
    "zero_optimization": {
        "stage": 0,
        "overlap_comm": None,  # None -> True for stage 3, False otherwise (DeepSpeed)
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
                              # minizero's extension (not in DeepSpeed's master): the paper's
                              # one-step delayed parameter update,
                              # after this many plain steps; null = off
                              "dpu_warmup_steps": None},
        "offload_param": {"device": "none", "nvme_path": None, "pin_memory": False,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "zero_quantized_weights": False,      # ZeRO++ qwZ: int8 weight all-gathers (stage 3)
        # ZeRO++ hpZ: ranks per node holding a secondary partition; 1 = off
        "zero_hpz_partition_size": 1,
        # ZeRO++ qgZ: int4 hierarchical all-to-all gradient reduce
        "zero_quantized_gradients": False,
        # MiCS / hybrid sharding (zero/hybrid.py): ZeRO-3 over groups of this many ranks, replicated
        # across them; -1 (or 0) = off, as in DeepSpeed. The
        # groups are booked as nodes (bytes intra / cross group)
        "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False,
        # minizero's extension: how stage 3 cuts parameters (zero/fsdp.py). "flat": each unit's
        # parameters as one flat buffer cut in N (DeepSpeed's and FSDP1's); "per_param": every
        # parameter cut on dim 0 into equal padded pieces, torch FSDP2's (fully_shard) layout
        "shard_layout": "flat",
    },
    # DeepSpeed's async I/O for nvme offload; here plain files through a thread pool
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True, "use_gds": False},
    # DeepSpeed's section with its keys and defaults. Present = minizero's engine checkpoints every
    # block (activation_checkpointing.py); in DeepSpeed the model calls
    # deepspeed.checkpointing.checkpoint itself (Megatron's --checkpoint-activations). Only the
    # defaults are implemented (CHECKPOINTING_NOT_IMPLEMENTED).
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                 "contiguous_memory_optimization": False,
                                 "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "pipeline": {
        "stages": 1,  # pipeline stages; the rest of the world is data parallel
        # DeepSpeed's partition_method: "parameters" or "uniform" (see below)
        "partition": "parameters",
        "micro_batches": None,  # = gradient_accumulation_steps, as in DeepSpeed's PipelineEngine
        "schedule": "1f1b",  # minizero extra: gpipe, 1f1b, interleaved_1f1b or zb_h1
        "chunks": 1,  # minizero extra: model chunks per rank (Megatron's virtual stages)
    },
    # DeepSpeed's key for DeepSpeed-Ulysses: cp ranks split every sequence (a Mesh cp axis); each
    # keeps s/cp tokens, attention runs Ulysses over them (minizero/context/ulysses.py), gradients
    # are reduced over dp x cp
    "sequence_parallel_size": 1,
    # minizero's key (DeepSpeed has none; Megatron's --cp-comm-type p2p): how the
    # sequence_parallel_size ranks attend, "ulysses" (contiguous s/cp tokens, all-to-all to heads)
    # or "ring" (two mirrored chunks, K/V around the ring)
    "context_parallel": {"attention": "ulysses"},
    "tensor_parallel": {
        "autotp_size": 1,  # t: ranks that split every layer (Megatron TP); must divide the world
        # minizero extra: Megatron's SP (LayerNorms on s/t tokens), needs t > 1
        "sequence_parallel": False,
    },
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
    "sparse_gradients": "not part of this course",
    "communication_data_type": "remove it: gradients are communicated in the training dtype",
    "gradient_predivide_factor": "remove it: minizero averages after the reduction",
    "zero_allow_untested_optimizer": "remove it: any elementwise torch optimizer is allowed",
    "checkpoint": "use engine.save_checkpoint / load_checkpoint arguments",
    "data_types": "remove it",
    "dump_state": "remove it",
    "memory_breakdown": "engine.memory() returns the ledger",
    "zero_optimization.round_robin_gradients": "remove it (an ordering optimization for offload)",
    "zero_optimization.load_from_fp32_weights": "remove it: checkpoints always hold fp32 masters",
    "zero_optimization.elastic_checkpoint": "remove it",
    "zero_optimization.ignore_unused_parameters": "remove it: unused parameters are always handled",
    "zero_optimization.legacy_stage1": "remove it",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "renamed in DeepSpeed: use stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.offload_optimizer.pipeline_read": "remove it",
    "zero_optimization.offload_optimizer.pipeline_write": "remove it",
    "fp16.auto_cast": "remove it: inputs are cast by the engine",
    "bf16.immediate_grad_update": "remove it",
}

# Real DeepSpeed keys minizero accepts at DeepSpeed's default (or disabled) value only, where they
# change nothing; any other value is refused, naming the key, the value accepted and why.
# torch_autocast is a section: accepted with "enabled":
# false (DeepSpeed's default), its other keys then unread.
AT_DEFAULT_ONLY = {
    "prescale_gradients": (False, "minizero averages the gradients after the reduction"),
    "fp16.fp16_master_weights_and_grads": (False,
                                           "DeepSpeed runs it only with ZeRO-Offload and "
                                           "DeepSpeedCPUAdam (its _enforce_cpu_offload), whose "
                                           "fp16 host masters minizero's host tier does not "
                                           "emulate: its masters are fp32"),
    "bf16.check_grad_overflow": (False, "bf16 training does not check for overflow here"),
}
DISABLED_SECTIONS = {"torch_autocast": (
    ("enabled", "dtype", "lower_precision_safe_modules"),
    "keep it disabled and run the forward under torch.autocast yourself (with "
    "torch.autocast(device_type, dtype=torch.bfloat16): loss = criterion(engine(x), y)): fp32 "
    "weights and the forward's ops in bf16, as DeepSpeed's section runs the forward (it also "
    "reduces the gradients of lower_precision_safe_modules in that dtype, not emulated here); or "
    "the bf16 section for bf16 weights with fp32 masters")}
# A number DeepSpeed reads without a type check, where JSON's Infinity means "never"
# (steps_per_print).
INFINITY_ALLOWED = {"steps_per_print"}
# DeepSpeed's deprecated keys, mapped as DeepSpeed maps them
# (config_utils._process_deprecated_field), with its warning: old key -> (new key in the same
# section, the new key's value for the old one's, or None for none).
DEPRECATED = {
    "zero_optimization.cpu_offload": ("offload_optimizer",
                                      lambda v: {"device": "cpu"} if v else None),
    "zero_optimization.cpu_offload_params": ("offload_param",
                                             lambda v: {"device": "cpu"} if v else None),
}

# activation_checkpointing keys whose DeepSpeed meaning minizero does not implement: only the
# default is accepted.
CHECKPOINTING_NOT_IMPLEMENTED = {
    "partition_activations": "splitting the kept block inputs across the tensor-parallel ranks",
    "cpu_checkpointing": "moving the kept block inputs to the CPU (DeepSpeed: with "
                         "partition_activations)",
    "contiguous_memory_optimization": "copying the kept block inputs into one preallocated buffer",
    "number_checkpoints": "the size of that contiguous buffer",
    "synchronize_checkpoint_boundary": "torch.cuda.synchronize() at each block boundary",
    "profile": "timing each checkpointed block's forward and recompute",
}

# Keys that look like DeepSpeed's but are not, found in configs written for DeepSpeed.
NOT_DEEPSPEED = {
    "zero_optimization.offload_gradients": "DeepSpeed has no such key: with offload_optimizer set, "
                                           "ZeRO-Offload already keeps the fp32 gradients on the "
                                           "CPU",
}

# Real DeepSpeed keys minizero accepts (so DeepSpeed configs load) but that change nothing here.
# Setting one to a non-default value warns, naming it and saying why, instead of passing silently.
NO_EFFECT = {
    "zero_optimization.mics_hierarchical_params_gather": "a shard group is one (simulated) node "
                                                         "here: its all-gather never crosses "
                                                         "nodes, so there is no hierarchy to add",
    "zero_optimization.offload_optimizer.buffer_count": "the disk tier keeps one sub-group "
                                                        "reading, one stepping",
    "zero_optimization.offload_optimizer.fast_init": "the disk tier always writes the initial "
                                                     "state once",
    "zero_optimization.offload_param.buffer_count": "the shards are whole host tensors (cpu) or "
                                                    "mapped files (nvme)",
    "zero_optimization.offload_param.buffer_size": "the shards are whole host tensors (cpu) or "
                                                   "mapped files (nvme)",
    "zero_optimization.offload_param.max_in_cpu": "the shards are whole host tensors (cpu) or "
                                                  "mapped files (nvme)",
    "aio.block_size": "files are read and written whole per sub-group (numpy fromfile/tofile)",
    "aio.queue_depth": "files are read and written whole per sub-group (numpy fromfile/tofile)",
    "aio.single_submit": "files are read and written whole per sub-group (numpy fromfile/tofile)",
    "aio.use_gds": "no GPUDirect Storage here: files go through host memory",
    "zero_optimization.stage3_max_live_parameters": "FSDP never holds more than one unit plus one "
                                                    "prefetched",
    "zero_optimization.stage3_max_reuse_distance": "FSDP frees every unit after use",
    "zero_optimization.allgather_bucket_size": "ZeRO-1/2 all-gather the whole flat buffer in one "
                                               "call",
    "zero_optimization.contiguous_gradients": "gradients always live in contiguous flat buffers "
                                              "here",
    "zero_optimization.reduce_scatter": "minizero always reduce-scatters (or reduces to owners)",
    "zero_optimization.allgather_partitions": "minizero always all-gathers the partitions",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "checkpoints hold fp32 masters; `python -m minizero consolidate` writes the full weights",
}


# DeepSpeed's type of each value (its config docs and pydantic models). Not listed: the type of the
# default in SCHEMA (bool, int, or "number" for a float). JSON's 5e8 is a float, so an "int" may be
# written as an integral float, as DeepSpeed's own configs do; true/false are never numbers, and
# "false" (a string) is never a boolean.
TYPES = {
    # the batch triple: null (or "auto") = derived from the other two (_resolve_batch)
    "train_batch_size": "int?", "train_micro_batch_size_per_gpu": "int?",
    "gradient_accumulation_steps": "int?", "optimizer.type": "str", "scheduler.type": "str",
    "optimizer.params": "object", "scheduler.params": "object", "sparse_attention": "object?",
    "fp16.loss_scale": "number", "fp16.min_loss_scale": "number",
    "zero_optimization.overlap_comm": "bool",
    **{f"zero_optimization.{k}": "int" for k in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "sub_group_size", "mics_shard_size")},
    **{f"zero_optimization.{s}.{k}": t for s in ("offload_optimizer", "offload_param")
       for k,
       t in (("device", "str"), ("nvme_path", "str?"), ("buffer_size", "int"),
             ("max_in_cpu", "int"))},
    "pipeline.micro_batches": "int?", "pipeline.partition": "str",
    "zero_optimization.offload_optimizer.dpu_warmup_steps": "int?",
}
# The optimizer's and scheduler's params that minizero knows (torch's names); others reach torch,
# which names an unexpected one.
PARAM_TYPES = {
    "lr": "number", "weight_decay": "number", "eps": "number", "momentum": "number",
    "dampening": "number", "betas": "pair", "nesterov": "bool", "amsgrad": "bool",
    "adam_w_mode": "bool", "torch_adam": "bool", "warmup_min_lr": "number",
    "warmup_max_lr": "number", "warmup_min_ratio": "number", "cos_min_ratio": "number",
    "warmup_num_steps": "int", "total_num_steps": "int", "warmup_type": "str", "freeze_step": "int",
    "cuda_aware": "bool", "comm_backend_name": "str", "bias_correction": "bool",
}
# Lower bounds of the values whose range the config alone decides: (bound, inclusive).
MINIMUM = {
    "gradient_clipping": (0, True), "steps_per_print": (1, True),
    "zero_optimization.reduce_bucket_size": (0, False),
    "zero_optimization.allgather_bucket_size": (0, False),
    "zero_optimization.stage3_prefetch_bucket_size": (0, True),
    "zero_optimization.stage3_param_persistence_threshold": (0, True),
    "zero_optimization.zero_hpz_partition_size": (1, True), "pipeline.stages": (1, True),
    "pipeline.chunks": (1, True), "pipeline.micro_batches": (1, True),
    "tensor_parallel.autotp_size": (1, True), "sequence_parallel_size": (1, True),
    "zero_optimization.offload_optimizer.dpu_warmup_steps": (0, True),
}
_WORDS = {"bool": "a boolean (true or false)", "int": "an integer", "number": "a number",
          "str": "a string", "object": "a JSON object", "pair": "a list of two numbers",
          "str?": "a string or null", "int?": "an integer or null"}


def _is(kind: str, value) -> bool:
    if kind.endswith("?"):
        return value is None or _is(kind[:-1], value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return _is("number", value) and float(value).is_integer()
    if kind == "pair":
        return (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(_is("number", v) for v in value)
        )
    return isinstance(value, {"str": str, "object": dict}[kind])


def check_type(path: str, value, kind: str):
    if not _is(kind, value):
        raise ConfigError(
            f"'{path}' must be {_WORDS[kind]}, got {value!r} ({type(value).__name__})"
        )


def _kind(path: str, default) -> str | None:
    if path in TYPES:
        return TYPES[path]
    if isinstance(default, bool):
        return "bool"
    return "int" if isinstance(default, int) else "number" if isinstance(default, float) else \
        "str" if isinstance(default, str) else None


class ConfigWarning(UserWarning):
    pass


def warn(message: str, stacklevel: int = 3):
    """A warning about the job's one config: rank 0 says it (every rank reads the same file), as
    DeepSpeed's logger does, instead of once per rank."""
    if launched_rank() == 0:
        warnings.warn(message, ConfigWarning, stacklevel=stacklevel)


# OneBitAdam: compression/onebit_adam.py, stage 0
OPTIMIZERS = ("Adam", "AdamW", "SGD", "OneBitAdam")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class ConfigError(ValueError):
    pass


def _check_keys(given: dict, schema: dict, where: str, out: dict):
    for key, value in given.items():
        path = f"{where}.{key}" if where else key
        if _accepted_as_deepspeed(path, key, value, given, out):
            continue
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
                    raise ConfigError(f"'{path}' does not accept \"auto\" in minizero; give a "
                                      "value (the ones that do: "
                                      f"{', '.join(sorted(AUTO_DEFAULTS))}).")
                value = AUTO_DEFAULTS[path]
            if _kind(path, default):
                check_type(path, value, _kind(path, default))
            if key == "params":
                for name, v in value.items():
                    if name in PARAM_TYPES:
                        check_type(f"{path}.{name}", v, PARAM_TYPES[name])
            low, inclusive = MINIMUM.get(path, (None, True))
            if (
                low is not None
                and value is not None
                and not (value > low or inclusive and value == low)
            ):
                raise ConfigError(f"'{path}' must be {'at least' if inclusive else 'more than'} "
                                  f"{low}, got {value!r}")
            if _kind(path, default) in ("int", "int?") and isinstance(value, float):
                value = int(value)  # DeepSpeed's 5e8: an integer written as a JSON float
            if path in NO_EFFECT and value != default:
                warn(f"'{path}': {value!r} has no effect in minizero: {NO_EFFECT[path]}.")
            out[key] = copy.deepcopy(value)


def _accepted_as_deepspeed(path: str, key: str, value, given: dict, out: dict) -> bool:
    """A key DeepSpeed accepts that minizero takes at its default, maps (deprecated) or reads as
    Infinity: True when handled here, a ConfigError when the value is one minizero does not
    implement."""
    if path in AT_DEFAULT_ONLY:
        accepted, why = AT_DEFAULT_ONLY[path]
        if type(value) is type(accepted) and value == accepted:
            return True
        raise ConfigError(f"'{path}': {json.dumps(value)} is not implemented by minizero ({why}); "
                          f"only DeepSpeed's default {json.dumps(accepted)} is accepted: set that "
                          "or remove the key.")
    if path in DISABLED_SECTIONS:
        keys, instead = DISABLED_SECTIONS[path]
        if not isinstance(value, dict) or set(value) - set(keys):
            raise ConfigError(f"'{path}' must be a JSON object with keys among {', '.join(keys)}, "
                              f"got {value!r}")
        if value.get("enabled", False) is False:
            return True
        raise ConfigError(f"'{path}.enabled': true is not implemented by minizero: {instead}; "
                          f"\"enabled\": false (DeepSpeed's default) is accepted.")
    if path in INFINITY_ALLOWED and value == float("inf"):
        out[key] = float("inf")  # `step % inf` is never 0 after step 0: never
        return True
    if path in DEPRECATED:
        new_key, mapped = DEPRECATED[path]
        check_type(path, value, "bool")
        if new_key in given:
            raise ConfigError(f"'{path}' is DeepSpeed's deprecated spelling of "
                              f"'{path.rpartition('.')[0]}.{new_key}': give one of them, not both "
                              "(DeepSpeed refuses both too)")
        warn(f"Config parameter {key} is deprecated use {new_key} instead")  # DeepSpeed's words
        if mapped(value) is not None:
            out[new_key] = mapped(value)
        return True
    return False


def _fill_defaults(schema: dict, out: dict, where=""):
    for key, default in schema.items():
        path = f"{where}.{key}" if where else key
        if isinstance(default, dict) and key != "params":
            if key in ("optimizer", "scheduler", "activation_checkpointing") and key not in out:
                out[key] = None  # optional sections: absent means none
                continue
            _fill_defaults(default, out.setdefault(key, {}), path)
        elif key not in out:
            if default is REQUIRED:
                raise ConfigError(f"'{path}' is required when '{where}' is given")
            out[key] = copy.deepcopy(default)


# sequences: far past any micro batch, accumulation or global batch (GPT-3's was 1536 x 2048)
MAX_BATCH = 2 ** 20


def _resolve_batch(cfg: dict, world_size: int):
    """DeepSpeed's rule: give any two of (train_batch_size, micro batch, accumulation) and the
    third is derived; give all three and they must satisfy train = micro * acc * world."""
    train, micro, acc = (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"],
                         cfg["gradient_accumulation_steps"])
    for name, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                    ("gradient_accumulation_steps", acc)):
        if v is not None and (not isinstance(v, int) or not 0 < v <= MAX_BATCH):
            raise ConfigError(f"{name} must be a whole number in [1, {MAX_BATCH}], got {v!r}")
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
            raise ConfigError(f"train_batch_size {train} is not divisible by "
                              f"gradient_accumulation_steps {acc} x world size {world_size}")
    elif train is None:
        acc = acc or 1
        train = micro * acc * world_size
    if train != micro * acc * world_size:
        raise ConfigError("Check batch related parameters. train_batch_size is not equal to "
                          f"micro_batch_per_gpu * gradient_acc_step * world_size {train} != "
                          f"{micro} * {acc} * {world_size}")
    cfg.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
               gradient_accumulation_steps=acc)


PIPELINE_SCHEDULES = tuple(SCHEDULES)  # the schedules minizero.pipeline implements

# Why minizero's pipeline engine, like DeepSpeed's
# PipelineEngine (it asserts stage < 2), refuses ZeRO-2/3.
PP_ZERO_MSG = (
    "zero_optimization.stage {stage} cannot be combined with pipeline parallelism in minizero's "
    "pipeline engine (pipeline.stages = {stages}), nor in DeepSpeed's PipelineEngine, which "
    "asserts stage < 2 (torchtitan does combine FSDP with a pipeline). A pipeline accumulates "
    "every micro-batch's gradient until the step: ZeRO-2 reducing its shard after each of the {m} "
    "micro-batches' backwards sends {m}x the gradient traffic of ZeRO-1, keeping the full "
    "gradients until the last backward instead holds ZeRO-1's memory plus the shard, ZeRO-3 also "
    "re-gathers the stage's parameters for every micro-batch, and the tied embedding's gradient "
    "must then be summed over its shards, which this engine does not do (lesson 09 section 9 "
    "measures all of it: minizero_course.experiments.pp_zero). Use stage 0 or 1 with a pipeline, "
    "or ZeRO-3 without one.")


def _data_parallel_size(cfg: dict, world_size: int) -> int:
    """The ranks that split the batch: the world over the pipeline stages, the tensor-parallel and
    the sequence-parallel ranks (DeepSpeed's dp world: a sequence-parallel group shares its
    rows)."""
    stages, tp, sp = (
        cfg["pipeline"]["stages"],
        cfg["tensor_parallel"]["autotp_size"],
        cfg["sequence_parallel_size"],
    )
    if world_size % (stages * tp * sp):
        names = f"pipeline.stages = {stages} x tensor_parallel.autotp_size = {tp}" + \
            (f" x sequence_parallel_size = {sp}" if sp > 1 else "")
        raise ConfigError(f"{names} does not divide the world size {world_size}: launch a multiple "
                          f"of {stages * tp * sp} ranks (the ranks beyond one pipeline are data "
                          "parallel)")
    return world_size // (stages * tp * sp)


def _check_pipeline(cfg: dict):
    pipe, zero = cfg["pipeline"], cfg["zero_optimization"]
    stages = pipe["stages"]
    if stages > 1 and zero["stage"] in (2, 3):
        m = cfg["gradient_accumulation_steps"] or pipe["micro_batches"] or "m"
        raise ConfigError(PP_ZERO_MSG.format(stage=zero["stage"], stages=stages, m=m))
    micro_batches = pipe["micro_batches"]
    if micro_batches is not None and cfg["gradient_accumulation_steps"] is None:
        cfg["gradient_accumulation_steps"] = micro_batches  # the same number, DeepSpeed's name
    if pipe["schedule"] not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline.schedule {pipe['schedule']!r} is not a schedule; valid "
                          f"schedules: {', '.join(PIPELINE_SCHEDULES)}")
    if pipe["partition"] not in ("parameters", "uniform"):
        raise ConfigError(f"pipeline.partition {pipe['partition']!r}: minizero cuts the blocks "
                          "into stages of equal block count ('uniform'; 'parameters' is accepted "
                          "when the blocks are of equal size, which the engine checks); "
                          "DeepSpeed's 'type:' partitions are not implemented")
    chunks = pipe["chunks"]
    if (chunks > 1) != (pipe["schedule"] == "interleaved_1f1b"):
        raise ConfigError(f"pipeline.chunks = {chunks} with schedule {pipe['schedule']!r}: "
                          "interleaved_1f1b needs chunks >= 2 model chunks per rank, the other "
                          "schedules run one")


def _check_micro_batches(cfg: dict):
    pipe, gas = cfg["pipeline"], cfg["gradient_accumulation_steps"]
    if pipe["micro_batches"] is not None and pipe["micro_batches"] != gas:
        raise ConfigError(f"pipeline.micro_batches = {pipe['micro_batches']!r} but "
                          f"gradient_accumulation_steps = {gas}: a pipeline's micro-batches are "
                          "the accumulation steps (DeepSpeed); give one of them")
    pipe["micro_batches"] = gas


def _check_zeropp(zero: dict, world_size: int, tp_size: int = 1):
    """ZeRO++'s keys, as DeepSpeed reads them: stage 3 only; hpZ groups must tile the world."""
    # ranks per node (1 = off); its type and range: TYPES, MINIMUM
    hpz = zero["zero_hpz_partition_size"]
    on = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if zero[k]] + \
        (["zero_hpz_partition_size"] if hpz > 1 else [])
    if on and zero["stage"] != 3:
        raise ConfigError(f"zero_optimization.{on[0]} is ZeRO++, which needs stage 3 (as in "
                          "DeepSpeed: it changes how sharded parameters are gathered and "
                          f"gradients reduce-scattered); got stage {zero['stage']}. Set \"stage\": "
                          "3 or remove it")
    offloaded = [s for s in ("offload_optimizer", "offload_param") if zero[s]["device"] != "none"]
    if on and offloaded:
        raise ConfigError(f"zero_optimization.{on[0]} (ZeRO++) with {offloaded[0]} is not "
                          "implemented in minizero: ZeroPP's gathers and reduces bypass the "
                          "offload hooks; use ZeRO++ or offload, not both")
    if on and tp_size > 1:
        raise ConfigError(f"zero_optimization.{on[0]} (ZeRO++) with "
                          f"tensor_parallel.autotp_size={tp_size} is not implemented in minizero: "
                          "ZeroPP shards over every rank of the world; set autotp_size 1 or turn "
                          "ZeRO++ off")
    if world_size % hpz:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={hpz} does not divide the "
                          f"world size {world_size}: hpZ's groups (simulated nodes) must tile the "
                          f"ranks; use a divisor of {world_size}")


def _no_duplicate_keys(pairs: list) -> dict:
    """json's object hook: a key given twice is an error (json keeps the last one without a word;
    DeepSpeed's loader refuses duplicates too)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"key {', '.join(map(repr, twice))} given twice in one object (JSON "
                          "would keep the last one silently): keep one")
    return dict(pairs)


class CheckedConfig(dict):
    """What load_config returns: a config already checked for `world_size` ranks (loading it again
    is a no-op)."""

    world_size = None


def _check_bf16_masters(cfg: dict):
    """bf16 master weights, gradients and optimizer states: DeepSpeed's rules (runtime/config.py
    _do_error_check, base_optimizer._configure_master_weights), then what minizero implements of
    them."""
    bf16, zero = cfg["bf16"], cfg["zero_optimization"]
    masters, states = bf16["bf16_master_weights_and_grads"], bf16["bf16_optimizer_states"]
    if not (masters or states):
        return
    key = "bf16.bf16_master_weights_and_grads" if masters else "bf16.bf16_optimizer_states"
    if not bf16["enabled"]:
        raise ConfigError(f"'{key}': true needs bf16.enabled true (the parameters in bf16)")
    # DeepSpeed asserts it: "... is only supported with ZeRO Stage 1, 2, or 3."
    if zero["stage"] == 0:
        raise ConfigError(
            f"'{key}': true needs ZeRO stage 1, 2 or 3 (as in DeepSpeed), got stage 0"
        )
    # DeepSpeed: "bf16_optimizer_states requires bf16_master_weights_and_grads"
    if states and not masters:
        raise ConfigError("'bf16.bf16_optimizer_states': true needs "
                          "bf16.bf16_master_weights_and_grads true too (as in DeepSpeed)")
    # DeepSpeed: ZeRO-Offload + DeepSpeedCPUAdam
    if not states or zero["offload_optimizer"]["device"] != "none":
        raise ConfigError(
            "'bf16.bf16_master_weights_and_grads' is implemented with "
            "bf16.bf16_optimizer_states true and offload_optimizer device none "
            "(master, gradient and optimizer state in bf16 on the device); DeepSpeed "
            "runs the other combinations only on its CPU Adam kernel under "
            "ZeRO-Offload, which minizero's host tier (fp32 masters) does not emulate"
        )
    if zero["stage"] == 3:
        raise ConfigError("'bf16.bf16_master_weights_and_grads' at ZeRO stage 3 is not implemented "
                          "by minizero (DeepSpeed allows it): use stage 1 or 2")


def load_json(config):
    """A JSON path -> its dict (each error naming the file); anything else as it is."""
    if not isinstance(config, (str, os.PathLike)):
        return config
    try:
        with open(config) as f:
            return json.load(f, object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config}: not valid JSON ({e})") from None
    except ConfigError as e:  # _no_duplicate_keys
        raise ConfigError(f"{config}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{config}: cannot read it ({e.strerror})") from None


def load_config(config, world_size: int = 1) -> dict:
    """A dict or a JSON path -> a complete, validated config (see module docstring)."""
    if isinstance(config, CheckedConfig):
        if config.world_size != world_size:
            raise ConfigError(f"this config was checked for {config.world_size} "
                              f"rank{'s' * (config.world_size != 1)}, not {world_size}: load the "
                              "JSON again for this world size")
        return config
    config = load_json(config)
    if not isinstance(config, dict):
        raise ConfigError("config must be a dict or a path to a JSON file, got "
                          f"{type(config).__name__}")
    cfg: dict = {}
    _check_keys(config, SCHEMA, "", cfg)
    _fill_defaults(SCHEMA, cfg)
    tp = cfg["tensor_parallel"]["autotp_size"]
    if world_size % tp:
        raise ConfigError(f"tensor_parallel.autotp_size={tp} does not divide the world size "
                          f"{world_size}: the world is (world / t) data-parallel groups of t "
                          f"tensor-parallel ranks. Launch a multiple of {tp} ranks, or choose a t "
                          f"that divides {world_size}")
    _check_pipeline(cfg)  # before the batch: the data-parallel size depends on the stages
    # DeepSpeed: split over the data-parallel ranks only
    _resolve_batch(cfg, _data_parallel_size(cfg, world_size))
    _check_micro_batches(cfg)
    if cfg["optimizer"] is not None and cfg["optimizer"]["type"] not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type {cfg['optimizer']['type']!r} is not one of "
                          f"{', '.join(OPTIMIZERS)}")
    if cfg["scheduler"] is not None and cfg["scheduler"]["type"] not in SCHEDULERS:
        raise ConfigError(f"scheduler.type {cfg['scheduler']['type']!r} is not one of "
                          f"{', '.join(SCHEDULERS)}")
    zero = cfg["zero_optimization"]
    if zero["stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
    if cfg["zero_init"] and zero["stage"] != 3:
        raise ConfigError("zero_init: true builds the model under zero.Init, which needs ZeRO "
                          f"stage 3, got stage {zero['stage']}")
    if zero["overlap_comm"] is None:
        zero["overlap_comm"] = zero["stage"] == 3
    if cfg["fp16"]["enabled"] and cfg["bf16"]["enabled"]:
        raise ConfigError("fp16 and bf16 are both enabled; choose one")
    _check_bf16_masters(cfg)
    for section in ("offload_optimizer", "offload_param"):
        dev = zero[section]["device"]
        if dev not in ("none", "cpu", "nvme"):
            raise ConfigError(f"zero_optimization.{section}.device must be none, cpu or nvme, got "
                              f"{dev!r}")
        if dev == "nvme" and not zero[section]["nvme_path"]:
            raise ConfigError(
                f"zero_optimization.{section}.device is nvme but nvme_path is not set"
            )
    _check_zeropp(zero, world_size, tp)
    _check_offload(zero)
    _check_shard_layout(zero)
    _check_activation_checkpointing(cfg["activation_checkpointing"])
    attention = cfg["context_parallel"]["attention"]
    if attention not in ("ulysses", "ring"):
        raise ConfigError("context_parallel.attention must be 'ulysses' or 'ring', got "
                          f"{attention!r}")
    if attention != "ulysses" and cfg["sequence_parallel_size"] == 1:
        raise ConfigError(f"context_parallel.attention {attention!r} needs sequence_parallel_size "
                          "> 1 (the ranks that split each sequence)")
    checked = CheckedConfig(cfg)
    checked.world_size = world_size
    return checked


def _check_activation_checkpointing(section):
    """Present: every block is checkpointed. A key set away from DeepSpeed's default asks for
    something minizero does not do: an error naming it, never a setting silently ignored."""
    defaults = SCHEMA["activation_checkpointing"]
    for key, value in (section or {}).items():
        if value != defaults[key]:
            raise ConfigError(f"'activation_checkpointing.{key}': {value!r} is not implemented in "
                              "minizero (in DeepSpeed it means "
                              f"{CHECKPOINTING_NOT_IMPLEMENTED[key]}); remove it. The section "
                              "itself turns on torch.utils.checkpoint for every block.")


def _check_shard_layout(zero: dict):
    """zero_optimization.shard_layout: "flat", or "per_param" on plain stage 3 (the sharded stages'
    other paths, ZeRO-1/2, ZeRO++, MiCS and offload, cut flat buffers)."""
    layout = zero["shard_layout"]
    if layout not in ("flat", "per_param"):
        raise ConfigError("zero_optimization.shard_layout must be 'flat' or 'per_param', got "
                          f"{layout!r}")
    if layout == "flat":
        return
    others = [
        key
        for key, on in (
            ("zero_quantized_weights", zero["zero_quantized_weights"]),
            ("zero_hpz_partition_size", zero["zero_hpz_partition_size"] > 1),
            ("zero_quantized_gradients", zero["zero_quantized_gradients"]),
            ("mics_shard_size", zero["mics_shard_size"] > 0),
            ("offload_optimizer", zero["offload_optimizer"]["device"] != "none"),
            ("offload_param", zero["offload_param"]["device"] != "none"),
        )
        if on
    ]
    if zero["stage"] != 3 or others:
        what = f"stage {zero['stage']}" if zero["stage"] != 3 else "zero_optimization." + others[0]
        raise ConfigError("zero_optimization.shard_layout 'per_param' (FSDP2's per-parameter "
                          f"shards) is implemented for plain ZeRO stage 3, not with {what}; remove "
                          "the key or use 'flat'")


def _check_offload(zero: dict):
    """The offload combinations DeepSpeed refuses, and the ones minizero does not implement."""
    from minizero.memory import offload_stage_error
    opt, param = zero["offload_optimizer"], zero["offload_param"]
    where = "zero_optimization.offload_optimizer"
    wrong = offload_stage_error(zero["stage"], opt["device"], param["device"])
    if wrong:
        raise ConfigError(f"zero_optimization.{wrong}")
    if param["device"] == "nvme" and opt["device"] != "nvme":
        raise ConfigError("zero_optimization.offload_param.device='nvme' needs "
                          "offload_optimizer.device='nvme' in minizero (ZeRO-Infinity: the disk "
                          "optimizer keeps the parameter files); or use 'cpu' for the parameter "
                          "shards")
    if param["device"] != "none" and opt["device"] == "none":
        raise ConfigError("zero_optimization.offload_param without offload_optimizer: offload the "
                          "optimizer state first (it is 12 of the 16 bytes per parameter)")
    if opt["ratio"] != 1.0:
        raise ConfigError(f"{where}.ratio={opt['ratio']}: partial offload is not implemented; "
                          "remove it (1.0)")
    if opt["dpu_warmup_steps"] is not None:  # null (off) or an integer >= 0: TYPES, MINIMUM
        if opt["device"] != "cpu":
            raise ConfigError(f"{where}.dpu_warmup_steps (the delayed parameter update) needs "
                              f"device 'cpu', got {opt['device']!r}")
    if (
        zero["sub_group_size"] != SCHEMA["zero_optimization"]["sub_group_size"]
        and opt["device"] != "nvme"
    ):
        warn(f"'zero_optimization.sub_group_size': {zero['sub_group_size']!r} has an effect only "
             "with offload_optimizer.device 'nvme' (the disk tier's piece); elsewhere minizero "
             "steps each rank's shard as one group", stacklevel=4)

