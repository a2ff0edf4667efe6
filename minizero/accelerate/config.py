"""Accelerate's configuration on minizero: its config YAML, the ACCELERATE_* variables
`accelerate launch` sets, its plugins, and the DeepSpeed config it hands the engine, with "auto"
filled as Accelerate fills it.

    # what `accelerate launch --config_file` exports
    env = yaml_to_env(load_yaml("default_config.yaml"))
    # the Accelerator's: arguments, then the variables
    settings = resolve(mixed_precision=None, ...)
    # for minizero.initialize
    ds = deepspeed_config(settings, micro_batch=8, world_size=2, model=model)

Names and defaults are Accelerate 1.15's (accelerate/commands/config/cluster.py writes the YAML,
accelerate/utils/launch.py turns it into variables, accelerate/utils/dataclasses.py's
DeepSpeedPlugin and accelerator.py's _prepare_deepspeed read them back). Every value is checked
here, before any rank meets another: a bad one is a ConfigError naming the key and what is allowed.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

from minizero import env as mz_env
from minizero.runtime.config import ConfigError

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP")
NOT_COVERED_TYPES = ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
                     "XLA", "MEGATRON_LM")
MIXED_PRECISION = ("no", "fp16", "bf16")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# FSDP's sharding strategies as minizero's ZeRO stages (FSDP1's ShardingStrategy names)
FSDP_STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}

# The keys `accelerate config` writes that change nothing for one machine here: accepted, not read.
INERT_KEYS = {"compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity",
              "machine_rank", "main_training_function", "rdzv_backend", "same_network", "tpu_env",
              "tpu_use_cluster", "tpu_use_sudo", "gpu_ids", "main_process_ip", "main_process_port",
              "dynamo_config", "use_cpu", "num_machines", "distributed_type", "mixed_precision",
              "num_processes", "deepspeed_config", "fsdp_config"}
DEEPSPEED_KEYS = {"zero_stage", "offload_optimizer_device", "offload_param_device",
                  "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
                  "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_multinode_launcher",
                  "offload_optimizer_nvme_path", "offload_param_nvme_path"}
FSDP_KEYS = {"fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_version",
             "fsdp_auto_wrap_policy", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
             "fsdp_state_dict_type", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
             "fsdp_sync_module_states", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
             "fsdp_reshard_after_forward", "fsdp_activation_checkpointing"}


def default_config_file() -> str:
    """Accelerate's default path: $HF_HOME/accelerate/default_config.yaml (HF_HOME:
    ~/.cache/huggingface)."""
    home = os.environ.get("HF_HOME",
                          os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return os.path.expanduser(os.path.join(home, "accelerate", "default_config.yaml"))


def load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config_file {path}: no such file (write one with `accelerate "
                          "config`, or see docs/accelerate.md for the keys minizero reads)")
    # Accelerate's own dependency; its config files are YAML (or JSON, which YAML reads too)
    import yaml
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: an Accelerate config is a mapping of keys (distributed_type: "
                          f"...), not {type(cfg).__name__}")
    return cfg


def _choice(cfg: dict, key: str, allowed, default, where: str = ""):
    value = cfg.get(key, default)
    if isinstance(value, str) and value.lower() in [str(a).lower() for a in allowed] and \
            not all(isinstance(a, int) for a in allowed):
        return next(a for a in allowed if str(a).lower() == value.lower())
    if value not in allowed:
        raise ConfigError(f"{where}{key}: {value!r} is not allowed: use one of "
                          f"{', '.join(map(str, allowed))}")
    return value


def _bool(cfg: dict, key: str, where: str) -> str | None:
    if key not in cfg or cfg[key] is None:
        return None
    if not isinstance(cfg[key], bool):
        raise ConfigError(f"{where}{key}: {cfg[key]!r} is not allowed: use true or false")
    return str(cfg[key]).lower()


def yaml_to_env(cfg: dict, path: str = "config") -> dict:
    """An Accelerate config -> the variables `accelerate launch` sets (utils/launch.py), and
    num_processes. Returns ({name: text}, num_processes); raises ConfigError for a key or value
    minizero cannot honour."""
    unknown = set(cfg) - INERT_KEYS - {"fsdp_config", "deepspeed_config"}
    for key in sorted(unknown):
        if key in ("megatron_lm_config", "fp8_config", "ipex_config", "mpirun_config",
                   "parallelism_config"):
            raise ConfigError(f"{path}: {key} is not covered by minizero.accelerate "
                              "(docs/accelerate.md lists what is); remove it")
        raise ConfigError(f"{path}: unknown key {key!r}; the keys Accelerate writes and minizero "
                          f"reads are {', '.join(sorted(INERT_KEYS))}")
    kind = cfg.get("distributed_type", "NO")
    if kind in NOT_COVERED_TYPES:
        raise ConfigError(f"{path}: distributed_type {kind} is not covered by minizero.accelerate: "
                          f"use one of {', '.join(DISTRIBUTED_TYPES)}")
    kind = _choice(cfg, "distributed_type", DISTRIBUTED_TYPES, "NO", f"{path}: ")
    mixed = _choice(cfg, "mixed_precision", MIXED_PRECISION, "no", f"{path}: ")
    if cfg.get("num_machines", 1) != 1:
        raise ConfigError(f"{path}: num_machines {cfg['num_machines']!r}: minizero.accelerate "
                          "launches one machine; use 1")
    nprocs = cfg.get("num_processes", 1)
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ConfigError(f"{path}: num_processes {nprocs!r} is not allowed: use a whole number >= "
                          "1")
    out = {"ACCELERATE_MIXED_PRECISION": mixed}
    if cfg.get("use_cpu") is True:
        out["ACCELERATE_USE_CPU"] = "true"
    if kind == "DEEPSPEED":
        out.update(_deepspeed_env(cfg.get("deepspeed_config") or {}, f"{path}: deepspeed_config."))
    elif cfg.get("deepspeed_config"):
        raise ConfigError(f"{path}: deepspeed_config is given but distributed_type is {kind}: set "
                          "distributed_type: DEEPSPEED, or remove deepspeed_config")
    if kind == "FSDP":
        out.update(_fsdp_env(cfg.get("fsdp_config") or {}, f"{path}: fsdp_config."))
    elif cfg.get("fsdp_config"):
        raise ConfigError(f"{path}: fsdp_config is given but distributed_type is {kind}: set "
                          "distributed_type: FSDP, or remove fsdp_config")
    return out, nprocs


def _only_known(section: dict, keys, where: str):
    unknown = set(section) - set(keys)
    if unknown:
        raise ConfigError(f"{where}{sorted(unknown)[0]}: not a key minizero reads; allowed: "
                          f"{', '.join(sorted(keys))}")


def _deepspeed_env(ds: dict, where: str) -> dict:
    _only_known(ds, DEEPSPEED_KEYS, where)
    out = {"ACCELERATE_USE_DEEPSPEED": "true"}
    if "zero_stage" in ds:
        out["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str(_choice(ds, "zero_stage", (0, 1, 2, 3), 2,
                                                             where))
    for key, var in (("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                     ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):
        if key in ds:
            out[var] = _choice(ds, key, OFFLOAD_DEVICES, "none", where)
    if "gradient_accumulation_steps" in ds:
        gas = ds["gradient_accumulation_steps"]
        if not isinstance(gas, int) or isinstance(gas, bool) or gas < 1:
            raise ConfigError(f"{where}gradient_accumulation_steps: {gas!r} is not allowed: use a "
                              "whole number >= 1")
        out["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(gas)
    if "gradient_clipping" in ds:
        clip = ds["gradient_clipping"]
        if clip != "auto" and (
            not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0
        ):
            raise ConfigError(f"{where}gradient_clipping: {clip!r} is not allowed: use a number >= "
                              "0 (or auto)")
        out["ACCELERATE_GRADIENT_CLIPPING"] = str(clip).lower()
    flag = _bool(ds, "zero3_init_flag", where)
    if flag is not None:
        out["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = flag
    if ds.get("deepspeed_config_file") not in (None, "none"):
        out["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(ds["deepspeed_config_file"])
    return out


def _fsdp_env(fsdp: dict, where: str) -> dict:
    _only_known(fsdp, FSDP_KEYS, where)
    out = {"ACCELERATE_USE_FSDP": "true"}
    if fsdp.get("fsdp_version", 1) not in (1, 2):
        raise ConfigError(f"{where}fsdp_version: {fsdp['fsdp_version']!r} is not allowed: use 1 or "
                          "2")
    if "fsdp_sharding_strategy" in fsdp:
        out["FSDP_SHARDING_STRATEGY"] = str(fsdp["fsdp_sharding_strategy"])
    elif fsdp.get("fsdp_reshard_after_forward") is False:  # FSDP2's way of saying SHARD_GRAD_OP
        out["FSDP_SHARDING_STRATEGY"] = "SHARD_GRAD_OP"
    flag = _bool(fsdp, "fsdp_offload_params", where)
    if flag is not None:
        out["FSDP_OFFLOAD_PARAMS"] = flag
    return out


# ---------------------------------------------------------------------------------------- plugins
@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeedPlugin, its fields and environment defaults (utils/dataclasses.py)."""
    hf_ds_config: object = None  # a DeepSpeed JSON path or dict; its "auto" values are filled
    gradient_accumulation_steps: object = None
    gradient_clipping: object = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    zero3_init_flag: bool | None = None
    is_train_batch_min: bool = True

    @property
    def deepspeed_config(self) -> dict:
        """The DeepSpeed config as far as the plugin knows it (scripts look for its "optimizer" and
        "scheduler" sections); the engine's, with "auto" filled, is built at prepare()."""
        if self.hf_ds_config is not None:
            return self.hf_ds_config
        return {"zero_optimization": {"stage": self.zero_stage},
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def __post_init__(self):
        read = _env_reader()
        if self.gradient_accumulation_steps is None:
            self.gradient_accumulation_steps = (
                read("ACCELERATE_GRADIENT_ACCUMULATION_STEPS") or "auto"
            )
        if self.gradient_clipping is None:
            self.gradient_clipping = read("ACCELERATE_GRADIENT_CLIPPING")
        if self.zero_stage is None:
            self.zero_stage = read("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeedPlugin(zero_stage={self.zero_stage!r}) is not allowed: "
                              "use 0, 1, 2 or 3")
        if self.offload_optimizer_device is None:
            self.offload_optimizer_device = read("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
        if self.offload_param_device is None:
            self.offload_param_device = read("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")
        for key in ("offload_optimizer_device", "offload_param_device"):
            if getattr(self, key) not in OFFLOAD_DEVICES:
                raise ConfigError(f"DeepSpeedPlugin({key}={getattr(self, key)!r}) is not allowed: "
                                  "use none, cpu or nvme")
        if self.hf_ds_config is None:
            self.hf_ds_config = read("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if isinstance(self.hf_ds_config, str):
            if not os.path.isfile(self.hf_ds_config):
                raise ConfigError(f"deepspeed_config_file {self.hf_ds_config}: no such file")
            with open(self.hf_ds_config) as f:
                self.hf_ds_config = json.load(f)
        if self.hf_ds_config is not None:
            if "zero_optimization" not in self.hf_ds_config:  # Accelerate's own check
                raise ConfigError("deepspeed_config_file: give its zero_optimization section "
                                  "(Accelerate requires it: 'Please specify the ZeRO optimization "
                                  "config in the DeepSpeed config.')")
            self.hf_ds_config = copy.deepcopy(self.hf_ds_config)
            self.hf_ds_config.setdefault("gradient_accumulation_steps", 1)
            stage = self.hf_ds_config["zero_optimization"].get("stage", self.zero_stage)
            self.zero_stage = stage if stage != "auto" else self.zero_stage
        if self.zero3_init_flag is None:
            init = read("ACCELERATE_DEEPSPEED_ZERO3_INIT")
            self.zero3_init_flag = (self.zero_stage == 3) if init is None else init
        if self.zero3_init_flag and self.zero_stage != 3:
            self.zero3_init_flag = False  # Accelerate warns and turns it off the same way


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, as minizero's ZeRO: FULL_SHARD is ZeRO-3, SHARD_GRAD_OP ZeRO-2,
    NO_SHARD DDP."""
    sharding_strategy: str | None = None
    cpu_offload: bool | None = None
    fsdp_version: int = 1
    extra: dict = field(default_factory=dict)
    # Accelerate's wrapping, prefetch and state-dict settings: accepted, as from the YAML, and
    # without effect (minizero's ZeRO-3 shards by its own units; save_state writes the engine's)
    state_dict_type: object = None
    state_dict_config: object = None
    optim_state_dict_config: object = None
    auto_wrap_policy: object = None
    backward_prefetch: object = None
    forward_prefetch: object = None
    use_orig_params: object = None
    sync_module_states: object = None
    cpu_ram_efficient_loading: object = None
    limit_all_gathers: object = None
    activation_checkpointing: object = None

    def __post_init__(self):
        read = _env_reader()
        if self.sharding_strategy is None:  # Accelerate's default: FULL_SHARD
            self.sharding_strategy = read("FSDP_SHARDING_STRATEGY") or "FULL_SHARD"
        # torch's enum or its name
        name = getattr(self.sharding_strategy, "name", self.sharding_strategy)
        if name == "HYBRID_SHARD":
            raise ConfigError(
                "FSDP sharding_strategy HYBRID_SHARD is not covered by "
                "minizero.accelerate: use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD "
                "(minizero's hybrid sharding is the engine's zero_hpz_partition_size)"
            )
        if name not in FSDP_STAGES:
            raise ConfigError(f"FSDP sharding_strategy {name!r} is not allowed: use FULL_SHARD, "
                              "SHARD_GRAD_OP or NO_SHARD")
        self.sharding_strategy = name
        if self.cpu_offload is None:
            self.cpu_offload = read("FSDP_OFFLOAD_PARAMS")
        self.zero_stage = FSDP_STAGES[name]


def _env_reader():
    """Accelerate's variables from the environment, over those of ACCELERATE_CONFIG_FILE when one is
    named (a script started by mpirun or torchrun, not by a launcher that exports them)."""
    environ = dict(os.environ)
    path = mz_env.accelerate_get("ACCELERATE_CONFIG_FILE")
    if path and not any(k.startswith(("ACCELERATE_USE_", "ACCELERATE_MIXED")) for k in environ):
        from_file, _ = yaml_to_env(load_yaml(path), path)
        environ = {**from_file, **environ}

    def read(name):
        try:
            return mz_env.accelerate_get(name, environ)
        except mz_env.EnvError as e:
            raise ConfigError(str(e)) from None
    return read


# ---------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    distributed_type: str           # NO, MULTI_CPU, MULTI_GPU, DEEPSPEED or FSDP
    mixed_precision: str            # no, fp16, bf16
    gradient_accumulation_steps: int
    cpu: bool                       # the CPU was asked for (cpu=True, ACCELERATE_USE_CPU)
    stage: int                      # minizero's ZeRO stage (0: DDP)
    deepspeed_plugin: DeepSpeedPlugin | None = None
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None

    @property
    def steps_in_backward(self) -> bool:
        """DeepSpeed's engine steps inside accelerator.backward and clips by its config; DDP and
        FSDP step at optimizer.step() and clip where the script calls clip_grad_norm_ (Accelerate's
        two paths)."""
        return self.distributed_type == "DEEPSPEED"


def resolve(mixed_precision, gradient_accumulation_steps, cpu, deepspeed_plugin, fsdp_plugin,
            world_size: int, cuda: bool) -> Settings:
    """The Accelerator's arguments over Accelerate's variables (AcceleratorState's order)."""
    read = _env_reader()
    if mixed_precision is None:
        mixed_precision = read("ACCELERATE_MIXED_PRECISION")
    if mixed_precision not in MIXED_PRECISION:
        raise ConfigError(f"Accelerator(mixed_precision={mixed_precision!r}) is not allowed: use "
                          "no, fp16 or bf16 (fp8 is not covered by minizero)")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ConfigError(
            f"Accelerator(gradient_accumulation_steps={gradient_accumulation_steps!r}) is not "
            "allowed: use a whole number >= 1"
        )
    if gradient_accumulation_steps == 1:
        gradient_accumulation_steps = read("ACCELERATE_GRADIENT_ACCUMULATION_STEPS") or 1
    cpu = bool(cpu or read("ACCELERATE_USE_CPU"))  # asked for; without CUDA the CPU is used anyway
    if deepspeed_plugin is None and read("ACCELERATE_USE_DEEPSPEED"):
        deepspeed_plugin = DeepSpeedPlugin()
    if fsdp_plugin is None and read("ACCELERATE_USE_FSDP"):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    if deepspeed_plugin is not None and fsdp_plugin is not None:
        raise ConfigError("both DeepSpeed and FSDP are asked for (deepspeed_plugin / "
                          "ACCELERATE_USE_DEEPSPEED and fsdp_plugin / ACCELERATE_USE_FSDP): pick "
                          "one")
    if deepspeed_plugin is not None:
        gas = deepspeed_plugin.gradient_accumulation_steps
        if gas != "auto" and gas != gradient_accumulation_steps:
            gradient_accumulation_steps = gas  # Accelerate: "Using DeepSpeed's value."
        return Settings("DEEPSPEED", mixed_precision, gradient_accumulation_steps, cpu,
                        deepspeed_plugin.zero_stage, deepspeed_plugin=deepspeed_plugin)
    if fsdp_plugin is not None:
        return Settings("FSDP", mixed_precision, gradient_accumulation_steps, cpu,
                        fsdp_plugin.zero_stage, fsdp_plugin=fsdp_plugin)
    kind = "NO" if world_size == 1 else "MULTI_CPU" if cpu or not cuda else "MULTI_GPU"
    return Settings(kind, mixed_precision, gradient_accumulation_steps, cpu, 0)


def deepspeed_config(s: Settings, micro_batch: int | None, world_size: int, model) -> dict:
    """The DeepSpeed config the engine gets: the plugin's (or its file's), "auto" filled as
    Accelerate's _prepare_deepspeed fills it. DDP and FSDP get the same config shape with their
    stage and no clipping (the script's clip_grad_norm_ sets it per step)."""
    plugin = s.deepspeed_plugin
    if plugin is not None and plugin.hf_ds_config is not None:
        cfg = copy.deepcopy(plugin.hf_ds_config)
    else:
        cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
               "gradient_accumulation_steps": s.gradient_accumulation_steps,
               "zero_optimization": {"stage": s.stage}}
        offload_opt = plugin.offload_optimizer_device if plugin else "none"
        offload_par = plugin.offload_param_device if plugin else "none"
        if s.fsdp_plugin is not None and s.fsdp_plugin.cpu_offload:
            offload_opt = offload_par = "cpu"
        if offload_opt != "none":
            cfg["zero_optimization"]["offload_optimizer"] = {"device": offload_opt}
        if offload_par != "none":
            cfg["zero_optimization"]["offload_param"] = {"device": offload_par}
        cfg["gradient_clipping"] = plugin.gradient_clipping if plugin else 0.0
        # zero3_init_flag is read by whoever builds the model (transformers' from_pretrained under
        # zero.Init); prepare() gets a model already built,
        # as Accelerate's does: nothing for the engine
    if micro_batch is None and _is_auto(cfg, "train_micro_batch_size_per_gpu"):
        raise ConfigError("under DeepSpeed, accelerator.prepare() needs a DataLoader with an "
                          "integer batch_size in the same call (or set "
                          "train_micro_batch_size_per_gpu in the DeepSpeed config file): it fills "
                          "train_micro_batch_size_per_gpu from it, as Accelerate does")
    fills = {"gradient_clipping": 1.0, "gradient_accumulation_steps": s.gradient_accumulation_steps,
             "zero_optimization.stage": s.stage}
    mbs = (
        micro_batch
        if _is_auto(cfg, "train_micro_batch_size_per_gpu")
        else cfg.get("train_micro_batch_size_per_gpu")
    )
    if mbs is not None:
        fills["train_micro_batch_size_per_gpu"] = mbs
        fills["train_batch_size"] = mbs * _value(cfg, "gradient_accumulation_steps",
                                                 s.gradient_accumulation_steps) \
            * world_size
    hidden = ("zero_optimization.reduce_bucket_size",
              "zero_optimization.stage3_prefetch_bucket_size",
              "zero_optimization.stage3_param_persistence_threshold")
    if any(_is_auto(cfg, k) for k in hidden):
        size = getattr(getattr(model, "config", None), "hidden_size", None)
        if size is None:
            raise ConfigError(f"the DeepSpeed config's {[k for k in hidden if _is_auto(cfg, k)]} "
                              "are \"auto\" and the model has no config.hidden_size to fill them "
                              "from (Accelerate's rule): give integers")
        fills.update({hidden[0]: size * size, hidden[1]: int(0.9 * size * size),
                      hidden[2]: 10 * size})
    fills["fp16.enabled"] = s.mixed_precision == "fp16"
    fills["bf16.enabled"] = s.mixed_precision == "bf16"
    for key, value in fills.items():
        if _is_auto(cfg, key):
            _set(cfg, key, value)
    if s.distributed_type == "DEEPSPEED" or s.mixed_precision == "fp16":
        # DeepSpeed's weights in 16 bits, fp32 masters (Accelerate's DS path)
        for name in ("fp16", "bf16"):
            if s.mixed_precision == name:
                cfg.setdefault(name, {})["enabled"] = True
    cfg["steps_per_print"] = float("inf")  # Accelerate's: DeepSpeed never logs to stdout
    cfg.pop("zero_allow_untested_optimizer", None)  # every torch optimizer is allowed here
    return cfg


def _node(cfg: dict, key: str):
    *path, last = key.split(".")
    for part in path:
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
        if cfg is None:
            return None, last
    return cfg, last


def _is_auto(cfg: dict, key: str) -> bool:
    node, last = _node(cfg, key)
    return node is not None and node.get(last) == "auto"


def _value(cfg: dict, key: str, default):
    node, last = _node(cfg, key)
    value = node.get(last, default) if node is not None else default
    return default if value == "auto" else value


def _set(cfg: dict, key: str, value):
    node, last = _node(cfg, key)
    node[last] = value
