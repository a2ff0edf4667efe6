"""minizero: how large models are trained across many GPUs, measured, in a few thousand lines.

DP -> DDP -> ZeRO-1/2/3 -> offload -> ZeRO++ -> pipeline and tensor parallelism.
See README.md for the course map and docs/api.md for the API summary.
"""
__version__ = "0.1.0"


def __getattr__(name):
    # `engine, optimizer, _, _ = minizero.initialize(model=model, config=cfg)`, DeepSpeed's entry point.
    # Imported on first use so that `import minizero` (the CLI, the grader) does not pay for torch.
    if name == "initialize":
        from minizero.runtime.initialize import initialize
        return initialize
    raise AttributeError(f"module 'minizero' has no attribute {name!r}")
