"""DeepSpeed's `deepspeed.ops` names: adam.DeepSpeedCPUAdam and adam.FusedAdam, on torch's Adam (no
C++ build)."""
from minizero.ops import adam

__all__ = ["adam"]
