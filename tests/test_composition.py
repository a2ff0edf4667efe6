"""One engine for every layout (runtime/engine.py's chain, runtime/strategies.py's protocol):

* checkpoints of 3D (dp 2 x pp 2 x tp 2, ZeRO-1), pipeline (DDP), tensor parallel (ZeRO-2, ZeRO-3) and
  plain data parallel runs resume BITWISE (every rank's masters and optimizer state, losses, lr);
  `consolidate` of the 3D checkpoint loads into a plain TinyGPT with strict=True and equals one process
  trained on the whole batch (rtol 1e-6); it reshards to dp 1 and refuses another tp size, clearly;
* `python -m minizero train` drives a pipeline config (train_batch) with its log and summary;
* every config error is raised before any collective (a communicator that records every call).
Two launches: composition_workers.py:resume on 8 ranks, :reshard on 4, and one `minizero train`."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minizero import launch
from minizero.models import EdgeCaseModel, GPTConfig, MLP, TinyGPT
from minizero.runtime.config import ConfigError
from tests import composition_workers as W

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

TARGET = "tests/composition_workers.py:"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("composition")
    return root, launch.run(TARGET + "resume", nprocs=8, args={"root": str(root)}, timeout=500)


@pytest.mark.parametrize("layout", list(W.LAYOUTS))
def test_every_layout_resumes_bitwise(resumed, layout):
    _, ranks = resumed
    coords = set()
    for out in ranks:
        run = out[layout]
        assert run["resumed"] == run["straight"], (layout, run["coords"])  # the same floats, not close ones
        assert run["resumed_digest"] == run["straight_digest"], (layout, run["coords"])
        assert run["resumed_lr"] == run["lr"] and run["global_steps"] == W.STEPS
        assert run["straight"][-1] < run["straight"][0]  # it trained
        coords.add(tuple(run["coords"]))
    stage, pipeline, tp = W.LAYOUTS[layout]
    pp = pipeline["stages"] if pipeline else 1
    assert len(coords) == 8 and {c[1] for c in coords} == set(range(pp)) and {c[2] for c in coords} == set(range(tp))


def test_offload_is_a_constructor_argument(resumed):
    """ShardedOptimizer / ShardGradOp / FSDPOptimizer(offload=OffloadSpec("cpu")) in a plain loop (8 ranks):
    the same parameters, bit for bit, as without offload, and each step moved this rank's shard (fp32 here)
    down once and up once: to_host = to_device = steps x 4 bytes x shard elements, nothing from disk."""
    _, ranks = resumed
    for out in ranks:
        for name, run in out["offload_loops"].items():
            assert run["bitwise"], (name, run)
            moved, expected = run["traffic"], run["steps"] * run["per_step"]
            assert expected > 0 and moved["to_host"] == expected and moved["to_device"] == expected, (name, run)
            assert moved["disk_read"] == moved["disk_written"] == 0, (name, moved)


def _one_process(steps, dp):
    """TinyGPT trained in this process on the whole global batch: SGD + momentum, the same warm-up,
    torch's clip_grad_norm_ (what every layout must equal)."""
    from minizero.runtime.schedulers import build_scheduler
    cfg = W.config("dp_zero1", dp)
    model = TinyGPT(GPTConfig(**W.GPT))
    opt = torch.optim.SGD(model.parameters(), **cfg["optimizer"]["params"])
    sched = build_scheduler(opt, cfg["scheduler"])
    for step in range(steps):
        x, y = W.batches(step, dp)
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"])
        opt.step()
        sched.step()
        opt.zero_grad()
    return model


def test_consolidated_3d_checkpoint_is_the_plain_model(resumed, tmp_path):
    from minizero.runtime.checkpoint import consolidate
    _, ranks = resumed
    run = ranks[0]["3d_zero1"]
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "minizero", "consolidate", run["dir"], str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sd = torch.load(out, weights_only=True)
    model = TinyGPT(GPTConfig(**W.GPT))
    model.load_state_dict(sd, strict=True)  # every key, every shape: tp slices put back, stages joined
    assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()  # the tied pair is one tensor
    ref = _one_process(W.STEPS, dp=2)
    moved = 0.0
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(sd[name], p, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        moved = max(moved, (p - TinyGPT(GPTConfig(**W.GPT)).state_dict()[name]).abs().max().item())
    assert moved > 1e-3  # the parameters did change: the comparison is not of the initial values
    full = torch.load(run["full"], weights_only=True)  # engine.full_state_dict() on the 8 ranks: the files' values
    assert all(torch.equal(full[k], v) for k, v in consolidate(run["dir"]).items())
    # the "end" tag (the straight run) and `latest` (the resumed one) hold the same model
    assert all(torch.equal(v, consolidate(run["dir"], tag="end")[k]) for k, v in sd.items())


def test_3d_checkpoint_reshards_over_dp_and_refuses_another_tp(resumed):
    root, ranks = resumed
    out = launch.run(TARGET + "reshard", nprocs=4, args={"root": str(root)}, timeout=300)
    from minizero.runtime.checkpoint import consolidate
    saved = consolidate(os.path.join(root, "3d_zero1"), tag="end")
    assert out[0]["global_steps"] == W.STEPS
    full = torch.load(out[0]["full"], weights_only=True)
    assert set(full) == set(saved) and all(torch.equal(full[k], v) for k, v in saved.items())
    for r in out:
        assert "saved with 2 tensor-parallel ranks (tp), this job has 1" in r["refused"], r["refused"]
        assert "Nothing was loaded" in r["refused"]


def test_train_cli_drives_a_pipeline_config(tmp_path):
    """`python -m minizero train` with a "pipeline" section on 4 ranks (dp 2 x pp 2, ZeRO-1, 1F1B):
    train_batch with the same log, bar-less progress and summary as the plain loop. Its first logged loss
    is one process's loss of the first global batch at initialization; it saves and resumes too."""
    from minizero.cli.train import batches
    from minizero.data import shard
    from minizero.models import build_model
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "seed": 3,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 1},
           "pipeline": {"stages": 2, "schedule": "1f1b", "partition": "uniform"}}
    path = tmp_path / "pipe.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "run"
    cmd = [launch.find_mpirun(), "-n", "4", sys.executable, "-m", "minizero", "train", "--config", str(path),
           "--steps", "3", "--out", str(out), "--save-every", "3", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO stage 1, dp 2 x pp 1 x tp 1" not in proc.stdout
    assert "ZeRO stage 1, dp 2 x pp 2 x tp 1, float32, 4 ranks, 2 x 2 accumulation x 2 data-parallel ranks = 8" \
        in proc.stdout, proc.stdout
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3] and log[-1]["loss"] < log[0]["loss"]
    model = build_model("tiny-gpt", seed=3)
    batch_of = batches("tiny-gpt", model, 3)
    rows = [shard(batch_of(i, 4), r, 2) for i in range(2) for r in range(2)]  # what each dp rank trained on
    with torch.no_grad():
        first = sum(model(x, y)[1] for x, y in rows).item() / 4
    assert log[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert (out / "checkpoints" / "global_step3" / "meta.json").exists() and (out / "loss.png").stat().st_size > 0


class SpyComm:
    """A communicator that answers size, rank and device, and records every other use (a collective)."""

    def __init__(self, size, device="cpu"):
        self.size, self.rank, self.device, self.calls = size, 0, torch.device(device), []

    def __getattr__(self, name):
        self.calls.append(name)
        raise AssertionError(f"a collective ({name}) ran before the config error")


def _gpt(**kw):
    return TinyGPT(GPTConfig(**{**W.GPT, **kw}))


BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
OFF = {"offload_optimizer": {"device": "cpu"}}
BAD = [  # (what, model, config, world, match, extra initialize kwargs)
    ("pipeline fp16", _gpt, {"fp16": {"enabled": True}, "pipeline": {"stages": 2}}, 4, "fp16 with pipeline", {}),
    ("pipeline offload", _gpt, {"zero_optimization": {"stage": 1, **OFF}, "pipeline": {"stages": 2}}, 4,
     "offload_optimizer.device 'cpu' with pipeline", {}),
    ("pipeline SP", _gpt, {"pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}},
     4, "sequence_parallel with pipeline", {}),
    ("more stages than blocks", _gpt, {"pipeline": {"stages": 8}}, 8, "pipeline: ", {}),
    ("no pipeline_parts", MLP, {"pipeline": {"stages": 2}}, 2, "needs a model cut into stages", {}),
    ("unequal blocks", lambda: _unequal(), {"pipeline": {"stages": 2}}, 2, "partition 'parameters'", {}),
    ("tp on an MLP", MLP, {"tensor_parallel": {"autotp_size": 2}}, 2, "nanoGPT-named model", {}),
    ("tp heads", lambda: _gpt(n_head=3, n_embd=48), {"tensor_parallel": {"autotp_size": 2}}, 2, "divisible|divide", {}),
    ("tp with SP at stage 3", _gpt, {"zero_optimization": {"stage": 3},
                                     "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}, 2,
     "sequence_parallel with zero_optimization.stage 3", {}),
    ("tp offload", _gpt, {"zero_optimization": {"stage": 2, **OFF}, "tensor_parallel": {"autotp_size": 2}}, 2,
     "offload with tensor parallelism", {}),
    ("nvme offload two groups", _gpt,
     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}, 2,
     "nvme steps its sub-groups as ONE group", {"groups": 2}),
    # one plain group (every parameter, no hyperparameter of its own) is accepted there: two are not
    ("tp groups", _gpt, {"tensor_parallel": {"autotp_size": 2}}, 2, "model_parameters with tensor_parallel",
     {"groups": 2}),
    ("pp groups", _gpt, {"pipeline": {"stages": 2}}, 2, "model_parameters with pipeline.stages", {"groups": 2}),
    ("zero.Init at stage 1", "init", {"zero_optimization": {"stage": 1}}, 2, "needs ZeRO stage 3", {}),
    ("offload_param on CUDA", _gpt, {"zero_optimization": {"stage": 3, **OFF, "offload_param": {"device": "cpu"}}}, 2,
     "offload_param is implemented for CPU runs only", {"device": "cuda"}),
    ("bad optimizer params", _gpt, {"optimizer": {"type": "SGD", "params": {"lr": -1.0}}}, 2, "optimizer/scheduler",
     {}),
    ("bad loss scaler", _gpt, {"fp16": {"enabled": True, "hysteresis": 0}}, 2, "fp16: ", {}),
    ("checkpointing without blocks", lambda: EdgeCaseModel(), {"activation_checkpointing": {}}, 2,
     "activation_checkpointing: EdgeCaseModel has no nn.ModuleList", {}),
    ("hpz vs the mesh", _gpt, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, 4,
     "the mesh has nodes of 4 ranks", {"mesh": True}),
    # sequence_parallel_size (DeepSpeed-Ulysses) and MoE ep_size (tests/test_engine_cp_ep.py trains them)
    ("sp world", _gpt, {"sequence_parallel_size": 3}, 4, "sequence_parallel_size = 3 does not divide the world", {}),
    ("sp heads", _gpt, {"sequence_parallel_size": 3}, 6, "n_head/cp whole heads, but the model has 4 heads", {}),
    ("sp block_size", lambda: _gpt(block_size=10), {"sequence_parallel_size": 4}, 4, "block_size 10 is not divisible",
     {}),
    ("sp pipeline", _gpt, {"sequence_parallel_size": 2, "pipeline": {"stages": 2}}, 4,
     "sequence_parallel_size=2 with pipeline.stages > 1: not implemented", {}),
    ("sp tp", _gpt, {"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 4,
     "sequence_parallel_size=2 with tensor_parallel.autotp_size > 1: not implemented", {}),
    ("sp ZeRO++", _gpt,
     {"sequence_parallel_size": 2, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     2, "sequence_parallel_size=2 with ZeRO\\+\\+", {}),
    ("ring block_size", lambda: _gpt(block_size=12),
     {"sequence_parallel_size": 4, "context_parallel": {"attention": "ring"}},
     4, "two chunks of seq_len/8 \\(ring attention's load balancing\\), and block_size 12", {}),
    ("ring without sp", _gpt, {"context_parallel": {"attention": "ring"}}, 2, "needs sequence_parallel_size > 1", {}),
    ("sp without the hook", MLP, {"sequence_parallel_size": 2}, 2, "needs a model that takes the context-parallel", {}),
    ("moe ep at stage 2", lambda: _gpt(num_experts=4, moe_ep_size=2), {"zero_optimization": {"stage": 2}}, 2,
     "MoE layers \\(ep_size=2\\) with zero_optimization.stage 2: not implemented", {}),
    ("moe ep groups at stage 1", lambda: _gpt(num_experts=4, moe_ep_size=2), {"zero_optimization": {"stage": 1}}, 2,
     "model_parameters with MoE layers of ep_size=2 at zero_optimization.stage 1", {"groups": 1}),
    ("moe ep vs dp", lambda: _gpt(num_experts=4, moe_ep_size=2), {}, 3, "ep_size=2 does not divide the 3 data-parallel",
     {}),
    ("moe with tp", lambda: _gpt(num_experts=4), {"tensor_parallel": {"autotp_size": 2}}, 2,
     "MoE layers \\(ep_size=1\\) with tensor_parallel.autotp_size > 1", {}),
    ("moe with a group", lambda: _moe_with_group(), {}, 2, "already runs over an expert-parallel group", {}),
]


def _moe_with_group():
    model = _gpt(num_experts=4)
    model.h[0].mlp.layer.ep_comm = SpyComm(2)  # a group set by hand: the engine would split the experts again
    return model


def _unequal():
    model = _gpt()
    model.h[0].mlp.c_fc = torch.nn.Linear(32, 256)  # a bigger first block
    model.h[0].mlp.c_proj = torch.nn.Linear(256, 32)
    return model


@pytest.mark.parametrize("what,make,cfg,world,match,kw", BAD, ids=[b[0] for b in BAD])
def test_every_config_error_comes_before_any_collective(what, make, cfg, world, match, kw):
    import minizero
    if make == "init":
        from minizero.zero import Init
        with Init():
            model = _gpt()
    else:
        model = make()
    spy = SpyComm(world, kw.get("device", "cpu"))
    extra = {}
    if "groups" in kw:
        params = list(model.parameters())
        extra["model_parameters"] = [{"params": params[:1]}, {"params": params[1:]}] if kw["groups"] == 2 \
            else [{"params": params}]
    if kw.get("mesh"):
        class FakeMesh:  # a mesh whose node is the whole world (no collective needed to read it)
            world, node_size = spy, 4
        extra = {"mesh": FakeMesh()}
    with pytest.raises(ConfigError, match=match):
        minizero.initialize(model=model, config={**BASE, **cfg}, **({} if "mesh" in extra else {"comm": spy}), **extra)
    assert spy.calls == [], spy.calls
