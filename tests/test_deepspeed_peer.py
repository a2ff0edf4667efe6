"""A script in DeepSpeed's examples' style, run unchanged but for its import line under real DeepSpeed and under
minizero (tests/deepspeed_examples/peer_train.py), compared step by step.

Two launches, one per library, each training every variant in turn on 2 ranks: ZeRO stages 0-3 in
fp32 and bf16, and stages 1-3 with the optimizer offloaded to the CPU, 10 optimizer steps of 2
micro-batches each, AdamW under WarmupLR with gradient clipping; two more in fp32 under
WarmupDecayLR and WarmupCosineLR, one with two engines alive at once, stages 0-3 with part of the
model frozen and every parameter in the script's own optimizer, and a 2-stage PipelineModule whose
shape changes between layers, given no shape. Before them the script calls torch.distributed itself
after init_distributed, as DeepSpeed's examples do. minizero's run is started by its launcher line,
as DeepSpeed's `deepspeed` command would start it; DeepSpeed's by its own `deepspeed` command (on
CPU: DS_ACCELERATOR=cpu, gloo), with its just-in-time C++ op builds off
(tests/deepspeed_examples/no_op_builds.py).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.machine import guard, retry_on_port_collision

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "tests/deepspeed_examples/peer_train.py"
INSTALL = "deepspeed is not installed: pip install -e '.[peers]' (deepspeed==0.19.8; no C++ op is built)"
# ":frozen": part of the model frozen, every parameter given to the script's own torch AdamW
FROZEN = ["0:fp32:frozen", "1:fp32:frozen", "2:fp32:frozen", "3:fp32:frozen"]
EXACT = ["0:fp32", "1:fp32", "2:fp32", "3:fp32", "1:bf16", "2:bf16", "1:offload", "2:offload", "3:offload",
         "1:fp32:WarmupDecayLR", "3:fp32:WarmupCosineLR", *FROZEN]
# bf16 where DeepSpeed keeps the gradients in fp32 and minizero in bf16 (see test_bf16_gradients_in_fp32)
BF16_FP32_GRADS = ["0:bf16", "3:bf16"]
VARIANTS = EXACT + BF16_FP32_GRADS
TWO_ENGINES = "2:fp32:two_engines"  # a second engine alive beside the first, stepped in turn
PIPE = "0:fp32:pipe"  # a 2-stage PipelineModule whose shape changes between layers, given no shape
LAUNCHED = VARIANTS + [TWO_ENGINES, PIPE]
STEPS, GAS = 10, 2
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.01, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 5}},
          "steps_per_print": 1000}


def _launch(argv, out_dir, extra_env):
    """argv(port): the launcher's command, its rendezvous on that port (a free one, retried when
    taken)."""
    (out_dir / "ds.json").write_text(json.dumps(CONFIG))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra_env)
    script = [SCRIPT, "--deepspeed", "--deepspeed_config", str(out_dir / "ds.json"), "--out_dir",
              str(out_dir), "--steps", str(STEPS), "--variants", ",".join(LAUNCHED)]
    proc = retry_on_port_collision(lambda port: subprocess.run(
        [*argv(port), *script], capture_output=True, text=True, timeout=guard(600), cwd=ROOT,
        env=env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    # gloo torn down under a peer aborts that peer with this line (C++'s), even when the job's code
    # is 0
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):]), proc.stderr


@pytest.fixture(scope="module")
def minizero_run(tmp_path_factory):
    return _launch(lambda port: [sys.executable, "-m", "minizero.launcher", "--num_gpus", "2",
                                 "--master_port", str(port)],
                   tmp_path_factory.mktemp("peer_minizero"), {"PEER_LIBRARY": "minizero"})


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip(INSTALL)
    command = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    accelerator = {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}
    # DeepSpeed's --master_port defaults to 29500, every other job's: a free one instead
    out, _ = _launch(lambda port: [command, "--num_gpus", "2", "--master_port", str(port),
                                   "tests/deepspeed_examples/no_op_builds.py"],
                     tmp_path_factory.mktemp("peer_deepspeed"), {"PEER_LIBRARY": "deepspeed", **accelerator})
    return out


def test_the_launcher_line_runs_the_script_and_its_engine_answers_as_deepspeeds(minizero_run):
    out, stderr = minizero_run
    assert f"2 ranks of {SCRIPT} under" in stderr
    assert (out["library"], out["world"], list(out["variants"])) == ("minizero", 2, LAUNCHED)
    for name in VARIANTS:
        run = out["variants"][name]
        stage, precision = name.split(":")[:2]
        assert (run["stage"], run["bf16"], run["offload"], run["fp16"]) == (
            int(stage), precision == "bf16", precision == "offload", False), name
        assert run["train_batch_size"] == 4 * GAS * 2 and run["local_rank"] == 0
        assert run["client_step"] == STEPS and run["load_path_found"]
        assert run["global_steps"] == STEPS + 1   # loaded at step 10, then one more
        assert run["after_load"] == run["after_save"], name   # the checkpoint put every weight and moment back
        first, last = sum(run["losses"][0] + run["losses"][1]), sum(run["losses"][-2] + run["losses"][-1])
        assert last < first - 0.1, name  # it trained


def test_deepspeed_runs_every_variant(deepspeed_run, minizero_run):
    assert deepspeed_run["library"] == "deepspeed" and list(deepspeed_run["variants"]) == LAUNCHED
    ours = minizero_run[0]["variants"]
    for name in VARIANTS:
        theirs = deepspeed_run["variants"][name]
        for key in ("stage", "bf16", "fp16", "offload", "global_steps", "train_batch_size", "local_rank", "device",
                    "client_step", "load_path_found", "optimizer_is_engines", "has_scheduler"):
            assert ours[name][key] == theirs[key], (name, key)
        assert theirs["after_load"] == theirs["after_save"], name


def _max_diff(a, b):
    assert len(a) == len(b) == STEPS * GAS
    return max(abs(x - y) for rank_a, rank_b in zip(a, b) for x, y in zip(rank_a, rank_b))


@pytest.mark.parametrize("variant", VARIANTS)
def test_learning_rates_are_deepspeeds_exactly(variant, deepspeed_run, minizero_run):
    theirs, ours = deepspeed_run["variants"][variant]["lrs"], minizero_run[0]["variants"][variant]["lrs"]
    assert len(ours) == STEPS * GAS and ours == theirs   # after every micro-step: each scheduler steps as DeepSpeed's
    # (two entries per step; the first is read before the first step)
    if variant.endswith("DecayLR"):    # linear warm-up over 5 steps, then down towards 0 at step 10
        assert theirs[:4] == [0, 0, 0, 0.002] and theirs[11] == 0.01 and theirs[-1] == 0.002 and len(set(theirs)) == 6
    elif variant.endswith("CosineLR"):  # ratios of lr 0.01: 0.1 -> 1 over 3 steps, then cosine down to 0.05
        assert theirs[:3] == [0, 0.001, 0.001] and theirs[5] == 0.01 and theirs[-1] == 0.0005 and len(set(theirs)) == 11
    else:                              # WarmupLR: log warm-up over 5 steps from 0, then 0.01
        assert theirs[0] == theirs[1] == 0 and theirs[-1] == 0.01 and len(set(theirs)) == 5


@pytest.mark.parametrize("variant", EXACT)
def test_losses_equal_deepspeeds_within_1e6(variant, deepspeed_run, minizero_run):
    theirs, ours = deepspeed_run["variants"][variant], minizero_run[0]["variants"][variant]
    assert _max_diff(ours["losses"], theirs["losses"]) <= 1e-6   # every micro-step, both ranks
    norms = [(a, b) for a, b in zip(ours["grad_norms"], theirs["grad_norms"]) if b is not None]
    assert all(abs(a - b) <= 1e-6 * b for a, b in norms), norms  # the clipped norm, where DeepSpeed reports it


@pytest.mark.parametrize("variant", BF16_FP32_GRADS)
def test_bf16_losses_within_two_bf16_steps(variant, deepspeed_run, minizero_run):
    # bf16 keeps 8 significant bits: a loss near 1.3 moves in steps of 2**-7 = 0.0078. Where the gradients are
    # rounded differently (below) the trajectories part after the first step with a nonzero learning rate;
    # measured: at most 0.0068 (stage 0) and 0.0013 (stage 3) over the 10 steps.
    theirs, ours = deepspeed_run["variants"][variant], minizero_run[0]["variants"][variant]
    assert _max_diff(ours["losses"], theirs["losses"]) <= 2 * 2**-7


@pytest.mark.xfail(strict=True, reason="DeepSpeed keeps bf16 gradients in fp32: at stage 0 its BF16_Optimizer "
                   "accumulates and all-reduces fp32 copies; at stage 3 the two micro-batches' gradients add up "
                   "otherwise (measured: equal with one micro-batch per step); minizero accumulates and reduces in "
                   "bf16 (the losses are compared within 2 x 2^-7 above; docs/deepspeed.md)")
@pytest.mark.parametrize("variant", BF16_FP32_GRADS)
def test_bf16_gradients_in_fp32(variant, deepspeed_run, minizero_run):
    theirs, ours = deepspeed_run["variants"][variant], minizero_run[0]["variants"][variant]
    assert _max_diff(ours["losses"], theirs["losses"]) <= 1e-6


def test_two_engines_alive_at_once_train_as_deepspeeds(deepspeed_run, minizero_run):
    theirs, ours = deepspeed_run["variants"][TWO_ENGINES], minizero_run[0]["variants"][TWO_ENGINES]
    assert ours["global_steps"] == theirs["global_steps"] == [STEPS, STEPS]
    for k in (0, 1):
        assert _max_diff(ours["losses"][k], theirs["losses"][k]) <= 1e-6, k
        assert ours["lrs"][k] == theirs["lrs"][k], k
    assert ours["losses"][0] != ours["losses"][1]  # two models, not one twice


def test_torch_distributed_runs_after_init_distributed_under_the_default_launcher(deepspeed_run,
                                                                                  minizero_run):
    # DeepSpeed's programs call torch.distributed themselves once init_distributed returned (rank
    # checks, barriers, metric all-reduces): under mpirun minizero starts it beside its own MPI
    # communicator
    ours = minizero_run[0]["torch_distributed"]
    for rank, probe in enumerate(ours):
        assert (probe["rank"], probe["world"], probe["sum"]) == (rank, 2, 3.0)
        assert probe["backend"] == "gloo"
        # minizero's collectives stay on MPI and count their own bytes: torch's all-reduce is not
        # among them, deepspeed.comm.all_reduce of 16 bytes on 2 ranks sends 2 (N-1)/N 16 = 16
        assert probe["minizero_backend"] == "mpi" and probe["minizero_sent"] == [0, 16.0], probe
    theirs = deepspeed_run["torch_distributed"]
    seen = [[(p["rank"], p["world"], p["sum"]) for p in run] for run in (theirs, ours)]
    assert seen[0] == seen[1]


@pytest.mark.parametrize("variant", FROZEN)
def test_frozen_parameters_in_the_optimizer_stay_as_they_were(variant, deepspeed_run, minizero_run):
    # the losses are compared with DeepSpeed's in test_losses_equal_deepspeeds_within_1e6; here: the
    # frozen layer never moved, in both libraries (torch's step skips a parameter without a
    # gradient)
    assert minizero_run[0]["variants"][variant]["frozen_unchanged"] is True
    if not variant.startswith("3:"):  # DeepSpeed's ZeRO-3 leaves empty placeholders in the module
        assert deepspeed_run["variants"][variant]["frozen_unchanged"] is True


def test_pipeline_learns_the_shapes_between_stages_and_trains_as_deepspeeds(deepspeed_run,
                                                                            minizero_run):
    theirs, ours = deepspeed_run["variants"][PIPE], minizero_run[0]["variants"][PIPE]
    assert len(ours["losses"]) == len(theirs["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1e-6
    assert ours["losses"][-1] < ours["losses"][0]  # it trained
    assert (ours["num_stages"], theirs["num_stages"]) == (2, 2)
