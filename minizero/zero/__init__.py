"""ZeRO (Rajbhandari et al. 2020): data parallelism without the redundant copies.

Each stage shards one more kind of model state over the N data-parallel ranks, and the class
is named after what it shards (the stage numbers are DeepSpeed's `zero_optimization.stage`):

    stage  class             file                  shards                          like
    1      ShardedOptimizer  sharded_optimizer.py  optimizer state (P_os)          DeepSpeed stage 1
    2      ShardGradOp       shard_grad_op.py      + gradients (P_os+g)            FSDP
                                                                                   SHARD_GRAD_OP
    3      FSDP              fsdp.py               + parameters (P_os+g+p)         FSDP FULL_SHARD
    3      ZeroPP            zeropp.py             ZeRO-3, less cross-node traffic DeepSpeed ZeRO++
                                                                                   (qwZ/hpZ/qgZ)
    3      HybridShard       hybrid.py             ZeRO-3 in a node, nodes replicas FSDP
                                                                                   HYBRID_SHARD,
                                                                                   MiCS

    flat_layout.py          FlatLayout: the parameters as views into one flat buffer padded to N
                            shards
    per_param_layout.py     PerParamLayout: FSDP2's cut, each parameter on dim 0 in N equal padded
                            pieces (FSDP(shard_layout="per_param"), zero_optimization.shard_layout)
    flat_shard_optimizer.py FlatShardOptimizer: a torch.optim.Optimizer (param groups, schedulers,
                            state_dict, torch's skip of grad-None parameters) over flat shards
    fsdp_optimizer.py       FSDPOptimizer: that optimizer on an FSDP model's shards (ZeRO-3)
    quantize.py             block-wise int8/int4 quantization and ZeRO++'s quantized collectives
                            (lab 08)
    offload.py              HostOptimizer: ZeRO-Offload, the optimizer step on the host (+ DPU)  Ren
                            et al. 2021
    infinity.py             DiskOptimizer: ZeRO-Infinity, masters and state in files by sub-group
                            (Rajbhandari et al. 2021)
    tiers.py                OffloadSpec: where a strategy's fp32 state lives, passed to its
                            constructor (ShardedOptimizer / ShardGradOp /
                            FSDPOptimizer(offload=OffloadSpec("cpu")))
    init.py                 Init: `with zero.Init(): model = ...` builds a ZeRO-3 model on the meta
                            device
    gathered.py             GatheredParameters: DeepSpeed's context; broadcasts modifier_rank's
                            edits of whole parameters, refuses FSDP's shards (they are whole only
                            inside forward)
"""
from minizero.zero.flat_layout import FlatLayout
from minizero.zero.per_param_layout import PerParamLayout
from minizero.zero.infinity import DiskOptimizer
from minizero.zero.init import Init
from minizero.zero.gathered import GatheredParameters
from minizero.zero.offload import HostOptimizer, Traffic
from minizero.zero.fsdp import FSDP
from minizero.zero.fsdp_optimizer import FSDPOptimizer
from minizero.zero.hybrid import HybridShard
from minizero.zero.shard_grad_op import ShardGradOp
from minizero.zero.sharded_optimizer import ShardedOptimizer
from minizero.zero.tiers import OffloadSpec
from minizero.zero.zeropp import ZeroPP

STAGES = {1: ShardedOptimizer, 2: ShardGradOp, 3: FSDP}

__all__ = ["DiskOptimizer", "FSDP", "FSDPOptimizer", "FlatLayout", "GatheredParameters",
           "HostOptimizer", "HybridShard", "Init", "OffloadSpec", "PerParamLayout", "STAGES",
           "ShardGradOp", "ShardedOptimizer", "Traffic", "ZeroPP"]
