"""minizero: how large models are trained across many GPUs, measured, in a few thousand lines.

DP -> DDP -> ZeRO-1/2/3 -> offload -> ZeRO++ -> pipeline and tensor parallelism.
See README.md for the course map and docs/api.md for the API summary.
"""
__version__ = "0.1.0"


# DeepSpeed's module surface, so that `import minizero as deepspeed` resolves what its scripts name
# (docs/deepspeed.md lists each name): deepspeed.<module> is minizero.<module> at DeepSpeed's path.
_SUBMODULES = ("accelerator", "checkpointing", "comm", "moe", "ops", "pipe", "runtime", "utils",
               "zero")
_FUNCTIONS = {"initialize": "minizero.runtime.initialize",
              "add_config_arguments": "minizero.arguments", "init_distributed": "minizero.comm"}


def __getattr__(name):
    # `engine, optimizer, _, _ = minizero.initialize(model=model, config=cfg)`, DeepSpeed's entry
    # point. Imported on first use so that `import minizero`
    # (the CLI, the grader) does not pay for torch.
    import importlib
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"minizero.{name}")
    raise AttributeError(f"module 'minizero' has no attribute {name!r}")
