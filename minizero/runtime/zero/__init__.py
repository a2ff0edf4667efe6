"""DeepSpeed's `deepspeed.runtime.zero` names that its programs import: offload_config's enums."""
from minizero.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
