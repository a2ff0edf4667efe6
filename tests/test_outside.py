"""Code minizero was not designed around, changed only at its wrapper line(s), trains what torch DDP trains.

tests/outside/nanogpt_train.py is nanoGPT's loop in this repo's words (per-rank seeds, the optimizer built
before wrapping with decay / no-decay groups, require_backward_grad_sync accumulation, clipping, a LambdaLR)
run under torch's own DistributedDataParallel and, in the same torchrun launch, minizero's DDP, ZeRO-1/2/3 and
the engine at stages 0-3 (DeepSpeed's loop and its initialize(model=, optimizer=, lr_scheduler=) call).
Tolerance 1e-6 in fp32: the modes differ only in summation order (sharded norms, reduce-scatter vs
all-reduce), a few float32 ulps of values of order 0.1 over 4 steps; the training itself moves the weights
by more than 1e-3, so a mode that trained something else (an unsynced init, a dropped group) fails.
"""
import json
import os
import subprocess
import sys

import pytest

from minizero import launch
from tests.machine import free_port, guard

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TRAINED = ["ddp", "zero1", "zero2", "zero3", "zero1:torch_clip", "zero2:torch_clip", "zero3:torch_clip",
           "engine0", "engine1", "engine2", "engine3"]   # within TOLERANCE of torch DDP
MODES = ["torch_ddp", *TRAINED, "engine0:bf16"]            # bf16: only its warnings are compared
TOLERANCE = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["TMPDIR"] = str(tmp_path_factory.mktemp("torchrun"))  # torchrun's torchelastic_* log folder, not /tmp's
    # torchrun's default port, 29500, is every other job's
    proc = subprocess.run([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()),
                           "tests/outside/nanogpt_train.py", ",".join(MODES)],
                          capture_output=True, text=True, timeout=guard(300), cwd=ROOT,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("mode", TRAINED)
def test_a_nanogpt_script_trains_what_torch_ddp_trains(results, mode):
    reference, ours = results["torch_ddp"], results[mode]
    moved = _max_diff(reference["state"], results["initial"]["state"])
    assert moved > 1000 * TOLERANCE, f"the reference barely trained ({moved:.1e}): the comparison would say nothing"
    assert max(abs(x - y) for x, y in zip(ours["losses"], reference["losses"])) <= TOLERANCE, ours["losses"]
    assert _max_diff(ours["state"], reference["state"]) <= TOLERANCE


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
def test_nanogpts_own_clip_line_gives_torch_ddps_norm(results, mode):
    reference, ours = results["torch_ddp"]["norms"], results[f"{mode}:torch_clip"]["norms"]
    assert min(reference) > 10 * results["clip"]  # it clipped every step: a norm read wrong would train something else
    assert max(abs(x - y) / y for x, y in zip(ours, reference)) <= TOLERANCE, (ours, reference)


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_nanogpts_checkpoint_lines_save_what_torch_ddp_saves_or_name_the_gathering_call(results, mode):
    """raw_model.state_dict() and optimizer.state_dict(), as nanoGPT saves them on rank 0: torch DDP's
    shapes and AdamW state, or an error at the call naming the call that gathers (then that call's result)."""
    reference, ours = results["torch_ddp"]["checkpoint"], results[mode]["checkpoint"]
    if mode == "zero3":
        assert "Call model.state_dict() on the FSDP wrapper on EVERY rank" in ours["model_error"]
    else:
        assert ours["model_error"] is None and ours["model"] == reference["model"]
    if mode == "zero3":
        return  # nanoGPT's optimizer here is torch's own AdamW on FSDP's local parts: its state is theirs
    if mode in ("zero1", "zero2"):
        assert "optimizer.consolidate_state_dict(to=0)" in ours["optimizer_error"]
    full, want = ours["optimizer"], reference["optimizer"]
    assert full["numel"] == want["numel"] and sorted(full["state"]) == sorted(want["state"])
    assert full["lr"] == want["lr"]
    for i, state in want["state"].items():
        assert sorted(full["state"][i]) == sorted(state)
        for k, v in state.items():
            assert max(abs(a - b) for a, b in zip(full["state"][i][k], v)) <= TOLERANCE, (i, k)


@pytest.mark.parametrize("mode", ["engine0", "engine1", "engine2", "engine3", "engine0:bf16"])
def test_the_engine_steps_its_scheduler_without_torchs_order_warning(results, mode):
    assert results[mode]["warnings"] == []


def test_a_hugging_face_gpt2_trains_consolidates_and_loads_strictly(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[outside]'")
    res = launch.run("tests/outside/hf_workers.py:run", nprocs=2, args={"tmp_dir": str(tmp_path)}, timeout=300)
    for out in res:
        assert out["fsdp_keys_match"], "FSDP's state_dict() lost or renamed a key of the HF model"
        assert out["fsdp_vs_single"] <= 1e-6, out["fsdp_vs_single"]  # fp32, SGD, 3 steps: summation order only
    assert res[0]["strict_load"] == [[], []]
    assert res[0]["engine_vs_single"] <= 1e-6, res[0]["engine_vs_single"]
