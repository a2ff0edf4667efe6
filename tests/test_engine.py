"""minizero.initialize: DeepSpeed's loop over minizero's building blocks, at N = 2 (and 3).

One 2-rank launch (tests/engine_workers.py) measures almost everything; the tests read it. A
3-rank launch repeats the SGD comparisons. Tolerances:
  * engine vs the building block driven by hand: BITWISE, fp32, SGD and Adam, every stage. The
    engine must add nothing but bookkeeping: same collectives, same order, same float ops.
  * engine vs one process on the full batch (same accumulation, torch's clip_grad_norm_):
    SGD atol 2e-7 at rtol 1e-6 (only the order of float additions differs; measured <= 3e-9);
    Adam 1e-3, a tenth of lr: TinyGPT has gradient elements that are zero in exact arithmetic
    and ~1e-11 in float32, and Adam's first update is about lr * sign(g), so one rounding can
    move a weight by up to lr (tests/test_zero12.py measured it; here 3e-5).
  * two accumulated micro-batches vs one double micro-batch: the SGD tolerance (the mean of two
    half-batch means is not rounded like one mean). Measured 7e-9.
Bytes per step come from comm.stats, memory from the ledger; the expected values from FlatLayout
and the model's shapes, never from the measured numbers.
"""
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import minizero
from minizero import comm as comm_mod
from minizero import launch
from minizero.runtime.config import ConfigError, load_config
from minizero.runtime.resolve import resolve
from minizero.zero.flat_layout import FlatLayout
from minizero.models import build_model

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/engine_workers.py:"
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)  # = engine_workers.GPT
N, ACC, CLIP = 2, 2, 0.5
EXAMPLES = sorted(glob.glob("configs/zero[0-3]_*.json"))  # every family: tests/test_config_matrix.py
F32 = 4
_job = []


def results():
    if not _job:
        with tempfile.TemporaryDirectory(prefix="minizero-engine-") as out_dir:  # the example runs' logs
            _job.append(launch.run(W + "correctness", nprocs=N, timeout=300,
                                   args={"configs": EXAMPLES, "out_dir": out_dir}))
    return _job[0]


def layout():
    model = build_model("tiny-gpt", seed=0, **GPT)
    return FlatLayout([p.shape for p in model.parameters() if p.requires_grad], N)


@pytest.mark.parametrize("stage", range(4))
def test_engine_equals_the_building_block_used_by_hand_bitwise(stage):
    for rank, r in enumerate(results()):
        for opt in ("sgd", "adam"):
            assert r[f"{stage}/{opt}/vs_hand"]["bitwise"], (
                f"stage {stage} {opt}, rank {rank}: engine differs from the block used by hand by "
                f"{r[f'{stage}/{opt}/vs_hand']['max_abs']:.3g}")
            sent, by_hand = r[f"{stage}/{opt}/sent_vs_hand"]
            assert sent == by_hand, f"stage {stage} {opt}: engine sent {sent} bytes in a step, by hand {by_hand}"


@pytest.mark.parametrize("stage", range(4))
def test_engine_equals_one_process_with_accumulation_and_clipping(stage):
    r = results()[0]
    sgd, adam = r[f"{stage}/sgd/vs_single"], r[f"{stage}/adam/vs_single"]
    assert sgd["atol_needed"] <= 2e-7, f"stage {stage} SGD: {sgd['max_abs']:.3g} from one process"
    assert adam["atol_needed"] <= 1e-3, f"stage {stage} Adam: {adam['max_abs']:.3g} from one process"
    ref, got = r["single/norms"], r[f"{stage}/sgd/norms"]
    assert max(ref) > CLIP, f"the clip never bit (norms {ref}): the test would prove nothing"
    assert got == pytest.approx(ref, rel=1e-5), f"stage {stage}: global norms {got}, torch's {ref}"
    assert r[f"{stage}/adam/norms"] == [None] * len(got)  # clipping off: no norm computed


def test_three_ranks_engine_equals_block_by_hand_and_one_process():
    """N = 3: shards cut through tensors elsewhere, padding; SGD with accumulation and clipping."""
    res = launch.run(W + "correctness_n3", nprocs=3, timeout=300)
    for stage in range(4):
        assert all(r[f"{stage}/vs_hand"]["bitwise"] for r in res), f"stage {stage} at N=3"
        single = res[0][f"{stage}/vs_single"]
        assert single["atol_needed"] <= 2e-7, f"stage {stage} at N=3: {single['max_abs']:.3g} from one process"


@pytest.mark.parametrize("stage", range(4))
def test_two_accumulated_micro_batches_equal_one_double_batch(stage):
    acc = results()[0][f"{stage}/accumulation"]
    assert acc["atol_needed"] <= 2e-7, f"stage {stage}: {acc['max_abs']:.3g} between 2 x micro and 1 x 2 micro"


def test_bytes_per_step_follow_deepspeeds_schedule():
    """Per optimizer step of ACC micro-batches (comm.stats of the last step):
    stage 0 all-reduces once (no_sync before the boundary), stage 1 reduce-scatters once and
    all-gathers, stage 2 reduces every micro-batch (as DeepSpeed's stage 2 does) and all-gathers;
    stages 1-2 add the clip norm's one-float all-reduce. Stage 3 sends more than stage 0."""
    L, r = layout(), results()[0]
    psi, P, f = L.numel, L.padded_numel, (N - 1) / N
    clip = 2 * f * F32
    assert r["0/sent"] == 2 * f * psi * F32
    assert r["1/sent_by_op"] == {"reduce_scatter": f * P * F32, "all_gather": f * P * F32, "all_reduce": clip}
    assert r["2/sent_by_op"] == {"reduce": ACC * f * P * F32, "all_gather": f * P * F32, "all_reduce": clip}
    assert r["3/sent"] > r["0/sent"]


@pytest.mark.parametrize("stage", range(4))
def test_start_up_broadcasts_the_model_once(stage):
    """Building the engine sends rank 0's model to the others once, as DeepSpeed's engine does
    (_broadcast_model): one broadcast payload of every parameter and buffer, nothing else. ZeRO-3
    broadcast it twice (the strategy, then FSDP's sync_module_states), which also hid FSDP's debug
    check that every rank started equal."""
    model = build_model("tiny-gpt", seed=0, **GPT)
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    startup = results()[0][f"{stage}/startup"]
    assert list(startup) == ["broadcast"], startup
    assert startup["broadcast"]["payload_bytes"] == model_bytes, (startup, model_bytes)


def test_ledger_shrinks_stage_by_stage():
    L, r = layout(), results()[0]
    S, P, psi = L.shard_numel, L.padded_numel, L.numel
    expected = {0: (psi, psi, psi), 1: (P, P, S), 2: (P, S, S)}  # params, grads, SGD momentum (elements)
    for stage, (params, grads, state) in expected.items():
        led = r[f"{stage}/ledger"]
        assert (led["parameters"], led["gradients"], led["optimizer_state"]) == \
            (params * F32, grads * F32, state * F32), f"stage {stage}: {led}"
    totals = [sum(r[f"{s}/ledger"].values()) for s in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals


def test_fp16_overflow_streak_lowers_the_scale_to_the_floor_then_raises():
    """Rank 1's loss is inf every step: the vote makes both ranks skip; 8 -> 4 -> 2 -> 1, then
    MinLossScaleError instead of a step on garbage. Skipped steps leave weights and lr alone."""
    for r in results():
        assert r["overflow/scales"] == [8.0, 4.0, 2.0, 1.0]
        assert "min_loss_scale=1" in r["overflow/error"] and "overflow" in r["overflow/error"]
        assert r["overflow/skipped"] == 3 and r["overflow/global_steps"] == [1, 2, 3]
        assert r["overflow/lrs"] == [1e-3] * 3, "the scheduler advanced on a skipped step"
        assert r["overflow/params_unchanged"]


def test_example_configs_train():
    for path in EXAMPLES:
        name = os.path.splitext(os.path.basename(path))[0]
        losses = results()[0][f"config/{name}"]
        assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses))), (name, losses)
        # configs with WarmupLR run steps 1 and 2 at lr 0, as DeepSpeed does: 5 steps to see the loss fall
        assert losses[-1] < losses[0], f"{name}: the loss did not fall in 5 steps: {losses}"


# ---------------------------------------------------------------------------- no ranks needed
@pytest.fixture
def no_collectives(monkeypatch):
    """initialize() must fail on a bad config before it creates a communicator."""
    def refuse(*a, **k):
        raise AssertionError("initialize() reached the communicator before rejecting the config")
    monkeypatch.setattr(comm_mod, "init", refuse)
    monkeypatch.setattr(comm_mod, "get", refuse)
    monkeypatch.setattr(comm_mod, "is_initialized", lambda: False)


@pytest.mark.parametrize("bad, message", [
    ({"zero_optimization": {"stgae": 2}}, "unknown config key 'zero_optimization.stgae'. Did you mean 'stage'"),
    ({"flops_profiler": {}}, "'flops_profiler' is a DeepSpeed key minizero does not implement"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}},
     "'activation_checkpointing.cpu_checkpointing': True is not implemented"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights is ZeRO++, which needs stage 3"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.zero_quantized_gradients (ZeRO++) with offload_optimizer is not implemented"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "needs ZeRO stage 1, 2 or 3"),
    ({"optimizer": None}, "the engine needs an 'optimizer' section"),
])
def test_bad_config_raises_before_any_collective(no_collectives, bad, message):
    base = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg = {k: v for k, v in {**base, **bad}.items() if v is not None}  # None: leave the section out
    with pytest.raises(ConfigError) as e:
        minizero.initialize(model=build_model("tiny-gpt"), config=cfg)
    assert message in str(e.value)


def test_seed_config_trains_unchanged_under_mpirun_4(tmp_path):
    """configs/ds_config_seed001.json as it is (stage 3, optimizer and parameters offloaded to the CPU,
    fp16, WarmupLR, batch 32 = 4 x 2 x 4 ranks): `mpirun -n 4 python -m minizero train` trains it."""
    out = tmp_path / "seed"
    stdout = _train_cli("--config", "configs/ds_config_seed001.json", "--steps", 2, "--out", out, "--no-progress", n=4)
    assert "ZeRO stage 3, float16, 4 ranks, 4 x 2 accumulation x 4 ranks = 32 per step" in stdout
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2], log
    cfg = json.loads(open("configs/ds_config_seed001.json").read())
    vocab = build_model("tiny-gpt").config.vocab_size  # the train command's default model
    # an untrained model is near uniform over the vocabulary: a wrong shard or scale moves it off ln(V)
    assert all(abs(x["loss"] - math.log(vocab)) < 0.1 for x in log), (math.log(vocab), log)
    # DeepSpeed's fp16 bookkeeping from the config: the first step runs at 2**initial_scale_power;
    # WarmupLR starts at warmup_min_lr, and a skipped (overflowed) step leaves the scheduler where it was
    assert log[0]["loss_scale"] == 2.0 ** cfg["fp16"]["initial_scale_power"], log[0]
    assert log[0]["lr"] == cfg["scheduler"]["params"]["warmup_min_lr"], log[0]
    if log[0]["skipped"]:
        assert log[1]["lr"] == log[0]["lr"], log
    held = log[-1]["memory_by_location"]
    assert held["host"] > 0 and log[-1]["offload_bytes"]["to_host"] > 0  # the optimizer state went to the host
    assert "offload (rank 0, last step): held device" in stdout


def test_example_configs_are_valid_at_any_world_size():
    """Each example config resolves at 1-4 ranks, keeping DeepSpeed's batch identity
    train_batch_size = micro x accumulation x ranks (the resolver fills what the file leaves out)."""
    for path in EXAMPLES:
        for n in (1, 2, 3, 4):
            cfg = load_config(path, world_size=n)
            resolve(cfg, n)
            assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"]
                                               * cfg["gradient_accumulation_steps"] * n), (path, n, cfg)


def _train_cli(*args, n=N):
    cmd = [launch.find_mpirun(), "-n", str(n), sys.executable, "-m", "minizero", "train", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_train_command_under_mpirun(tmp_path):
    """mpirun -n 2 python -m minizero train: progress bar, JSON lines, summary, PNG, checkpoints;
    then --resume from the step-4 checkpoint redoes step 5 bit for bit and goes on to 6."""
    out, cfg = tmp_path / "run", "configs/zero2_fp16.json"
    stdout = _train_cli("--config", cfg, "--steps", 5, "--save-every", 2, "--out", out)
    assert "5/5" in stdout  # tqdm on rank 0
    assert "ZeRO stage 2, float16, 2 ranks, 4 x 2 accumulation x 2 ranks = 16 per step" in stdout
    first = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in first] == [1, 2, 3, 4, 5]
    for x in first:
        assert {"loss", "lr", "loss_scale", "step_time_s", "sent_bytes", "memory"} <= x.keys()
        assert x["sent_bytes"] > 0 and x["memory"]["master_params"] > 0 and x["loss_scale"] >= 1
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "latest").read_text() == "global_step4"
    _train_cli("--config", cfg, "--steps", 6, "--resume", "--out", out, "--no-progress")
    again = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in again] == [1, 2, 3, 4, 5, 6]
    assert again[4]["loss"] == first[4]["loss"] and again[4]["lr"] == first[4]["lr"]
