"""minizero.accelerate against Hugging Face Accelerate: one script in Accelerate's examples' style
(tests/outside/accelerate_style_train.py) run by real Accelerate (DDP on CPU, torchrun, 2 ranks) and by
minizero's launcher with the article's `accelerate config` answers, then at DDP, ZeRO-1/2/3 and FSDP in the
same launch. Two launches for the module; the rest runs in-process (a world of one beside
Accelerate's)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from minizero.accelerate import config as acc_config
from minizero.accelerate import launch as acc_launch
from minizero.accelerate.data import shard_batches
from minizero.runtime.config import ConfigError, load_config
from tests.machine import guard, retry_on_port_collision

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "outside", "accelerate_style_train.py")
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
NEEDS_ACCELERATE = pytest.mark.skipif(not HAVE_ACCELERATE, reason="pip install accelerate==1.15.0 (pyproject's "
                                                                  "peers extra)")
VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp")
# `accelerate config`'s file for the article's answers: this machine, multi-GPU, DeepSpeed, ZeRO stage 2, no
# offload, accumulation 1, no clipping, bf16 (the keys Accelerate 1.15 writes)
ARTICLE_YAML = os.path.join(ROOT, "configs", "accelerate_deepspeed_zero2_bf16.yaml")


def _env(**extra):
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("ACCELERATE_", "FSDP_", "PMI_", "OMPI_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    return {**environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    out = {}
    cmd = [sys.executable, "-m", "minizero.accelerate.launch", "--config_file", ARTICLE_YAML, SCRIPT,
           "--peer", "minizero", "--variants", ",".join(VARIANTS), "--out", str(tmp / "minizero.json")]
    done = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True,
                          timeout=guard(600))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out["minizero"] = json.loads((tmp / "minizero.json").read_text())
    out["minizero_log"] = done.stdout + done.stderr
    if HAVE_ACCELERATE:
        cmd = [SCRIPT, "--peer", "accelerate", "--out", str(tmp / "accelerate.json")]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        done = retry_on_port_collision(lambda port: subprocess.run(
            [*torchrun, "--master-port", str(port), *cmd], cwd=tmp,
            env=_env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True,
            timeout=guard(600)))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        theirs = json.loads((tmp / "accelerate.json").read_text())
        out["accelerate"], out["accelerate_local_sgd"] = theirs["ddp"], theirs["local_sgd"]
    return out


@NEEDS_ACCELERATE
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_strategy_trains_as_accelerate_ddp(runs, variant):
    """Same losses (fp32, within 1e-6), learning rates, eval samples and accuracy as Accelerate's DDP."""
    ours, truth = runs["minizero"][variant], runs["accelerate"]
    assert len(ours["losses"]) == len(truth["losses"]) == 12
    assert max(abs(a - b) for a, b in zip(ours["losses"], truth["losses"])) < 1e-6
    assert ours["lrs"][:12] == pytest.approx(truth["lrs"][:12], abs=1e-12)
    assert ours["seen"] == truth["seen"] == [21, 21]  # gather_for_metrics dropped the repeated samples
    # the object path of gather_for_metrics too: each eval sample once, in the loader's order
    assert ours["eval_ids"] == truth["eval_ids"] == [list(range(21))] * 2
    assert ours["order"] == truth["order"]  # the shuffled loader's samples, each step, both ranks
    samples = [i for step in ours["order"] for i in step]
    assert len(samples) == 48 and set(samples) == set(range(44))  # 4 repeats complete the last step
    assert ours["saw_main_first"] == truth["saw_main_first"] == [1, 1]
    assert ours["info"]["is_a_distributed_type"] and truth["info"]["is_a_distributed_type"]
    assert ours["accuracy"] == truth["accuracy"]
    assert ours["info"]["steps_per_epoch"] == truth["info"]["steps_per_epoch"] == 6


@NEEDS_ACCELERATE
def test_save_state_and_load_state_resume_as_accelerate(runs):
    """The epoch after save_state, and the same epoch again after load_state: Accelerate's losses both times
    (the loader's order moves on, as Accelerate's does, so the two differ)."""
    ours, truth = runs["minizero"]["ddp"]["resumed"], runs["accelerate"]["resumed"]
    assert len(ours) == len(truth) == 2
    for a, b in zip(ours, truth):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-6


@NEEDS_ACCELERATE
def test_local_sgd_under_the_profiler_trains_as_accelerates(runs):
    """LocalSGD (every 2 steps) inside accelerator.profile(), both kwargs handlers passed: each
    rank's losses are Accelerate's, the ranks' weights drift apart between averages and are equal
    after the block; accelerator.state holds Accelerate's values."""
    ours, truth = runs["minizero"]["local_sgd"], runs["accelerate_local_sgd"]
    assert len(ours["losses"]) == len(truth["losses"]) == 6 and len(ours["losses"][0]) == 2
    assert max(abs(a - b) for x, y in zip(ours["losses"], truth["losses"])
               for a, b in zip(x, y)) < 1e-6
    assert ours["spread"][0] == pytest.approx(truth["spread"][0], abs=1e-6)
    assert ours["spread"][0] > 1e-3 and ours["spread"][1] == truth["spread"][1] == 0
    assert ours["events"] and truth["events"]
    assert ours["state"] == truth["state"] == ["MULTI_CPU", 2, 0, 0, "cpu", "no"]
    assert ours["state_repr"].startswith("Distributed environment: MULTI_CPU\nNum processes: 2\n")


def test_no_scheduler_warning_although_the_engine_steps_its_own_optimizer(runs):
    assert "lr_scheduler.step()" not in runs["minizero_log"] and "Traceback" not in runs["minizero_log"]


def test_the_strategies_are_what_they_say(runs):
    info = {k: runs["minizero"][k]["info"] for k in VARIANTS}
    assert [info[k]["stage"] for k in VARIANTS] == [0, 1, 2, 3, 3]
    assert [info[k]["distributed_type"] for k in VARIANTS] == ["MULTI_CPU", "DEEPSPEED", "DEEPSPEED", "DEEPSPEED",
                                                               "FSDP"]
    assert all(info[k]["clip"] == 0.5 for k in VARIANTS)


def test_the_articles_config_trains_through_minizero(runs):
    """DeepSpeed, ZeRO-2, bf16, accumulation 1, and Accelerate's "auto" clipping (1.0, although the article
    answered no clipping); the micro-batch is the DataLoader's."""
    article = runs["minizero"]["article"]
    assert article["info"] == {"num_processes": 2, "distributed_type": "DEEPSPEED",
                               "mixed_precision": "bf16", "is_a_distributed_type": True,
                               "steps_per_epoch": 6, "stage": 2, "bf16": True, "clip": 1.0, "micro_batch": 4}
    losses = article["losses"]
    assert sum(losses[6:]) / 6 < 0.8 * sum(losses[:6]) / 6, losses
    assert article["lrs"][:3] == pytest.approx([0.015, 0.025, 0.03])  # a step per batch: 2 scheduler steps each


# ---------------------------------------------------------------------------------------- in-process
@NEEDS_ACCELERATE
@pytest.mark.parametrize("n,drop_last", [(44, False), (21, False), (5, False), (23, True), (3, False)])
def test_the_shards_are_accelerates_batch_sampler_shards(n, drop_last):
    from accelerate.data_loader import BatchSamplerShard
    sampler = torch.utils.data.BatchSampler(range(n), batch_size=4, drop_last=drop_last)
    for rank in range(3):
        truth = list(BatchSamplerShard(sampler, num_processes=3, process_index=rank))
        assert shard_batches([list(b) for b in sampler], 3, rank, 4, drop_last) == truth


@NEEDS_ACCELERATE
def test_a_loop_that_stops_early_has_drawn_the_shuffle_as_far_as_accelerates():
    """A loop that breaks after the first batch (early stopping) leaves the sampler's generator
    where Accelerate's does, so the next epoch's order is Accelerate's too."""
    from accelerate.data_loader import BatchSamplerShard as Theirs

    from minizero.accelerate.data import BatchSamplerShard
    seen = []
    for cls in (Theirs, BatchSamplerShard):
        generator = torch.Generator().manual_seed(0)
        shuffle = torch.utils.data.RandomSampler(range(10), generator=generator)
        sampler = torch.utils.data.BatchSampler(shuffle, batch_size=2, drop_last=False)
        first = next(iter(cls(sampler, num_processes=2, process_index=1)))
        seen.append((first, generator.get_state()))
    assert seen[0][0] == seen[1][0] and torch.equal(seen[0][1], seen[1][1])


def test_the_articles_yaml_becomes_accelerate_launchs_variables():
    env, nprocs = acc_config.yaml_to_env(acc_config.load_yaml(ARTICLE_YAML))
    assert nprocs == 2
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_DEEPSPEED": "true",
                   "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
                   "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
                   "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}


def test_a_deepspeed_config_files_auto_values_are_filled_as_accelerate_fills_them(tmp_path, monkeypatch):
    """Accelerate's generated style: batch sizes, clipping, accumulation and bf16 "auto", hidden-size keys from
    model.config; minizero's loader then takes it (steps_per_print infinity included)."""
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    plugin = acc_config.DeepSpeedPlugin(hf_ds_config=str(path))
    s = acc_config.resolve("bf16", 2, True, plugin, None, world_size=4, cuda=False)
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"hidden_size": 16})()
    cfg = acc_config.deepspeed_config(s, micro_batch=3, world_size=4, model=model)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["train_batch_size"], cfg["gradient_accumulation_steps"],
            cfg["gradient_clipping"], cfg["bf16"]["enabled"]) == (3, 24, 2, 1.0, True)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 256
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 160
    assert cfg["steps_per_print"] == float("inf")
    loaded = load_config(cfg, world_size=4)
    assert (loaded["train_batch_size"], loaded["zero_optimization"]["stage"]) == (24, 3)
    del model.config
    with pytest.raises(ConfigError, match="config.hidden_size"):
        acc_config.deepspeed_config(s, micro_batch=3, world_size=4, model=model)


@pytest.mark.parametrize("yaml_text,words", [
    ("distributed_type: XLA\n", "distributed_type XLA is not covered"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n", "zero_stage: 4 is not allowed: use one "
                                                                           "of 0, 1, 2, 3"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_param_device: gpu\n",
     "offload_param_device: 'gpu' is not allowed: use one of none, cpu, nvme"),
    ("mixed_precision: fp8\n", "mixed_precision: 'fp8' is not allowed: use one of no, fp16, bf16"),
    ("num_processes: 0\n", "num_processes 0 is not allowed"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: -1\n", "gradient_clipping: -1 is not"),
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n", "HYBRID_SHARD"),
    ("distirbuted_type: NO\n", "unknown key 'distirbuted_type'"),
    ("num_machines: 2\n", "num_machines 2"),
])
def test_a_bad_config_is_one_line_exit_2_before_any_rank(yaml_text, words, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('a rank started')\n")
    code = acc_launch.main(["--config_file", str(path), str(script)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err, err


def test_a_bad_variable_names_it_and_what_is_allowed(monkeypatch):
    from minizero.accelerate import Accelerator
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "5")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"ACCELERATE_DEEPSPEED_ZERO_STAGE='5' is not allowed: use 0, 1, 2 or 3"):
        Accelerator()


@pytest.fixture
def world_of_one(monkeypatch):
    """The Accelerator creates the communicator in this process: gone again after the test."""
    from minizero import comm as comm_mod
    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    assert not comm_mod.is_initialized()
    yield
    comm_mod.shutdown()


@NEEDS_ACCELERATE
def test_the_names_examples_import_are_accelerates():
    """DistributedType's values are Accelerate's, and set_seed leaves random, numpy and torch where
    Accelerate's does."""
    import random

    import numpy as np
    from accelerate import DistributedType as Theirs
    from accelerate.utils import set_seed as their_set_seed

    from minizero.accelerate import DistributedType
    from minizero.accelerate.utils import set_seed
    assert {t.value for t in DistributedType} <= {t.value for t in Theirs}
    assert DistributedType.MULTI_CPU == Theirs.MULTI_CPU == "MULTI_CPU"
    assert str(DistributedType.FSDP) == "FSDP"
    draws = []
    for seed in (set_seed, their_set_seed):
        seed(7)
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]


@NEEDS_ACCELERATE
def test_a_shuffled_loader_draws_accelerates_order_in_a_world_of_one(world_of_one):
    """One process (no sharding): the same batches as Accelerate 1.15 for the same seed over two
    epochs, and torch's global generator where Accelerate leaves it after each (dropout draws from
    it next); with and without DataLoaderConfiguration(use_seedable_sampler=True)."""
    import accelerate
    from accelerate.state import AcceleratorState

    import minizero.accelerate as ours

    def run(lib, seedable):
        lib.utils.set_seed(42)
        accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.DataLoaderConfiguration(
            use_seedable_sampler=seedable))
        loader = torch.utils.data.DataLoader(torch.arange(10), batch_size=4, shuffle=True)
        loader = accelerator.prepare(loader)
        return [([b.tolist() for b in loader], torch.rand(1).item()) for _ in range(2)]

    try:
        for seedable in (False, True):
            truth = run(accelerate, seedable)
            assert run(ours, seedable) == truth
            assert truth[0][0] != truth[1][0]  # a new order each epoch
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_an_uncovered_dataloader_setting_names_it_and_what_is_allowed():
    from minizero.accelerate import Accelerator, DataLoaderConfiguration
    with pytest.raises(ConfigError, match=r"DataLoaderConfiguration\(even_batches=False\) is not "
                                          r"covered by minizero.accelerate: allowed True"):
        DataLoaderConfiguration(even_batches=False)
    with pytest.raises(ConfigError, match=r"rng_types=\['torch'\]\) is not covered by "
                                          r"minizero.accelerate: allowed None or \['generator'\]"):
        Accelerator(rng_types=["torch"])


def test_gradient_accumulation_steps_can_be_set_before_prepare(world_of_one):
    """automatic_gradient_accumulation.py sets it, then prepares: accumulate() syncs every k
    micro-batches."""
    from minizero.accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 3
    syncs = []
    for _ in range(6):
        with accelerator.accumulate():
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, True] * 2 and accelerator.gradient_accumulation_steps == 3
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 0 is not allowed: use a "
                                          r"whole number"):
        accelerator.gradient_accumulation_steps = 0


def test_the_prepared_models_no_sync_is_the_accelerators(world_of_one):
    """gradient_accumulation_for_autoregressive_models.py calls model.no_sync() (torch DDP's method,
    which Accelerate's prepared model has under DDP): its backwards accumulate without syncing."""
    from minizero.accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                       batch_size=4)
    model, _, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    seen = []
    with model.no_sync():
        seen.append(accelerator.sync_gradients)
    seen.append(accelerator.sync_gradients)
    assert seen == [False, True]


def test_a_schedule_free_optimizers_mode_reaches_the_optimizer_that_steps(world_of_one):
    """schedule_free.py calls optimizer.train() / eval() on the prepared optimizer (DDP, fp32)."""
    from minizero.accelerate import Accelerator
    calls = []

    class ScheduleFree(torch.optim.SGD):
        def train(self):
            calls.append(("train", self))

        def eval(self):
            calls.append(("eval", self))

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    data = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    model, optimizer, _ = accelerator.prepare(model, ScheduleFree(model.parameters(), lr=0.1), data)
    optimizer.train()
    optimizer.eval()
    assert [c[0] for c in calls] == ["train", "eval"]
    assert all(c[1] is model.engine.optimizer for c in calls)  # the engine's, which steps


def test_bf16_is_autocast_under_ddp_and_16_bit_weights_under_deepspeed(world_of_one):
    """Accelerate's two meanings of mixed_precision="bf16", in a world of one (distributed_type NO)."""
    from minizero.accelerate import Accelerator, DeepSpeedPlugin
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    kinds = {}
    for name, plugin in (("ddp", None), ("deepspeed", DeepSpeedPlugin(zero_stage=2))):
        torch.manual_seed(0)
        accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, data)
        (x,) = next(iter(loader))
        out = model(x)
        before = accelerator.unwrap_model(model).weight.detach().float().clone()
        accelerator.backward(out.float().pow(2).mean())
        optimizer.step()
        moved = (accelerator.unwrap_model(model).weight.detach().float() - before).abs().max().item()
        kinds[name] = (accelerator.distributed_type, out.dtype, accelerator.unwrap_model(model).weight.dtype, moved > 0)
    assert kinds["ddp"] == ("NO", torch.bfloat16, torch.float32, True)
    assert kinds["deepspeed"] == ("DEEPSPEED", torch.bfloat16, torch.bfloat16, True)


def test_a_schedulers_momentum_reaches_the_optimizer_that_steps(world_of_one):
    """OneCycleLR cycles Adam's betas as well as its lr (cv_example.py): the engine's optimizer
    takes every hyperparameter the scheduler set, so the second step is Accelerate's too."""
    from minizero.accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    data = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    for x in data:
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        scheduler.step()
    group = model.engine.optimizer.param_groups[0]
    assert group["betas"] == scheduler.optimizer.param_groups[0]["betas"]
    assert group["betas"][0] < 0.95 and group["lr"] > 0.004  # both moved off their start


def test_ddp_kwargs_other_than_the_defaults_and_other_handlers_name_what_is_covered():
    from minizero.accelerate import Accelerator
    from minizero.accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    assert DistributedDataParallelKwargs().comm_hook == DDPCommunicationHookType.NO
    # bucketing does not change what is reduced: accepted
    assert DistributedDataParallelKwargs(find_unused_parameters=True).find_unused_parameters
    with pytest.raises(ConfigError, match=r"\(broadcast_buffers=False\) is not covered"):
        DistributedDataParallelKwargs(broadcast_buffers=False)
    with pytest.raises(ConfigError, match=r"DistributedDataParallelKwargs\(comm_hook='fp16'\) is "
                                          r"not covered by minizero.accelerate: only 'no'"):
        DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(ConfigError, match=r"kwargs_handlers=\[int\(...\)\]\) is not covered.*"
                                          r"DistributedDataParallelKwargs and ProfileKwargs"):
        Accelerator(kwargs_handlers=[3])


def test_local_sgd_refuses_what_it_cannot_average(world_of_one):
    from minizero.accelerate import Accelerator, DeepSpeedPlugin
    from minizero.accelerate.local_sgd import LocalSGD
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    with pytest.raises(ConfigError, match=r"LocalSGD under DEEPSPEED is not covered"):
        LocalSGD(accelerator=accelerator, model=torch.nn.Linear(2, 2), local_sgd_steps=2)


def test_get_logger_logs_on_the_main_process_once_the_accelerator_exists(world_of_one, caplog):
    from minizero.accelerate import Accelerator
    from minizero.accelerate.logging import get_logger
    logger = get_logger("mz_acc_test", log_level="INFO")
    with pytest.raises(RuntimeError, match=r"create the Accelerator before logging"):
        logger.info("too early")
    Accelerator(cpu=True)
    with caplog.at_level("INFO", logger="mz_acc_test"):
        logger.info("main %d", 1)
        logger.info("every rank", main_process_only=False, in_order=True)
        logger.debug("below the level")
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] main 1", "[RANK 0] every rank"]


def test_the_state_names_the_deepspeed_plugin_and_dummy_optim_is_refused(world_of_one):
    """deepspeed_with_config_support.py picks DummyOptim when state.deepspeed_plugin's config has
    an "optimizer" section: without one it builds AdamW, which prepare() takes."""
    from minizero.accelerate import Accelerator, DeepSpeedPlugin
    from minizero.accelerate.utils import DummyOptim, DummyScheduler
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    state = accelerator.state
    assert state.deepspeed_plugin.deepspeed_config["zero_optimization"] == {"stage": 2}
    assert "optimizer" not in state.deepspeed_plugin.deepspeed_config
    assert (state.distributed_type, state.num_processes, state.fsdp_plugin) == \
        ("DEEPSPEED", 1, None)
    model = torch.nn.Linear(2, 2)
    optimizer = DummyOptim(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"got a DummyOptim: the DeepSpeed config's optimizer / "
                                          r"scheduler is not covered"):
        accelerator.prepare(model, optimizer, DummyScheduler(optimizer, total_num_steps=4))
