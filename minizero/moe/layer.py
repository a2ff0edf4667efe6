"""`deepspeed.moe.layer.MoE`'s import path: `from minizero.moe.layer import MoE` (the class is
moe/moe.py's)."""
from minizero.moe.moe import MoE

__all__ = ["MoE"]
