"""GPU checks in the suite where 2 CUDA GPUs are present (one rank per GPU, NCCL). On CPU they are skipped
with the reason; the CPU suite proves the same claims with the ledger. On ONE GPU, `make test-gpu`
(tests/gpu/check.py) checks every mechanism with several ranks sharing it."""
import pytest
import torch

from minizero import launch

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for 2 ranks with NCCL; this machine has {GPUS}")
def test_cuda_max_memory_allocated_is_ordered_ddp_z1_z2_z3():
    res = launch.run("minizero.cli.demo:train_worker", nprocs=2, timeout=600,
                     args={"steps": 3, "global_batch": 8, "progress": False})
    for rank_result in res:
        peak = {r["strategy"]: r["ledger"]["cuda_max_allocated"] for r in rank_result["runs"]}
        assert all(v is not None for v in peak.values()), peak
        assert peak["ddp"] > peak["zero1"] > peak["zero2"] > peak["zero3"], peak
        assert all(r["ledger"]["by_location"].get("device", 0) > 0 for r in rank_result["runs"])
