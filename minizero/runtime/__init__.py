"""The DeepSpeed-style runtime on top of the building blocks.

    initialize.py   minizero.initialize: DeepSpeed's signature -> (engine, optimizer, dataloader,
                    lr_scheduler)
    engine.py       build_engine(model, config) -> Engine: composes DDP / ZeRO-1/2/3, precision,
                    accumulation, clipping and schedulers from a DeepSpeed JSON config
    pipeline_engine.py  PipelineEngine: the engine when pipeline.stages > 1 (train_batch, as
                        DeepSpeed's)
    config.py       the DeepSpeed config subset: defaults, types, "auto", clear errors
    checkpoint.py   sharded "universal" checkpoints that reshard across world sizes and stages
    schedulers.py   DeepSpeed's LR schedulers (WarmupLR, ...)
    utils.py        set_random_seed, see_memory_usage (deepspeed.runtime.utils's)
    zero/           deepspeed.runtime.zero.offload_config's enums (OffloadDeviceEnum, ...)
"""


def __getattr__(name):
    # `deepspeed.runtime.utils.set_random_seed` reached
    # as an attribute (import minizero as deepspeed)
    if name in ("utils", "zero"):  # and deepspeed.runtime.zero.offload_config's enums
        import importlib
        return importlib.import_module(f"minizero.runtime.{name}")
    raise AttributeError(f"module 'minizero.runtime' has no attribute {name!r}")
