"""DeepSpeed's module surface under minizero (`import minizero as deepspeed`) and its launcher.

One launch: `python -m minizero.launcher --num_gpus 2 tests/outside/deepspeed_style_train.py --deepspeed
--deepspeed_config ds.json` (mpirun underneath) runs a script written in DeepSpeed's examples' style and
prints what it saw; the rest are in-process checks of each name against torch's own result or DeepSpeed's rule.
"""
import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import minizero as deepspeed
from minizero.comm import ring_bytes_sent
from minizero.launcher import runner
from minizero.runtime.config import ConfigError

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS_INSTALL = "deepspeed is not installed: pip install deepspeed==0.19.8 (the peers extra; no C++ ops are built)"

# the names DeepSpeed's examples and tutorials use, as `deepspeed.<path>`
SURFACE = ["initialize", "add_config_arguments", "init_distributed", "accelerator.get_accelerator",
           "comm.get_rank", "comm.get_world_size", "comm.get_local_rank", "comm.barrier", "comm.all_reduce",
           "comm.broadcast", "comm.all_gather", "comm.all_gather_into_tensor", "comm.reduce_scatter_tensor",
           "comm.all_to_all_single", "comm.all_gather_object", "comm.log_summary", "comm.ReduceOp", "comm.new_group",
           "comm.is_initialized",
           "comm.init_distributed", "pipe.PipelineModule", "pipe.LayerSpec", "utils.RepeatingLoader", "utils.logger",
           "utils.log_dist", "runtime.utils.set_random_seed", "runtime.utils.see_memory_usage", "moe.layer.MoE",
           "moe.utils.split_params_into_different_moe_groups_for_optimizer", "moe.utils.is_moe_param",
           "ops.adam.DeepSpeedCPUAdam", "ops.adam.FusedAdam", "checkpointing.checkpoint", "checkpointing.configure",
           "zero.Init", "zero.GatheredParameters", "runtime.zero.offload_config.OffloadDeviceEnum",
           "runtime.zero.offload_config.OffloadStateTypeEnum"]


def resolve(root, path):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dsurface")
    config = tmp / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                  "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
                                  "steps_per_print": 100}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-m", "minizero.launcher", "--num_gpus", "2",
                           "tests/outside/deepspeed_style_train.py", "--deepspeed", "--deepspeed_config", str(config),
                           "--save_dir", str(tmp / "ckpt")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):]), proc.stderr


def test_launcher_gives_each_rank_deepspeeds_arguments_and_environment(launched):
    out, stderr = launched
    assert "2 ranks of tests/outside/deepspeed_style_train.py under mpirun" in stderr
    assert out["world"] == 2
    assert out["local_rank_args"] == [0.0, 1.0]   # --local_rank=K appended, one per rank
    assert out["ranks_env"] == [0.0, 1.0]
    assert out["local_rank_env"] == out["get_local_rank"] == out["current_device"] == 0  # rank 0's
    assert out["deepspeed_flag"] is True


def test_accelerator_and_comm_in_the_job(launched):
    out, _ = launched
    assert (out["device_name"], out["current_device_name"], out["is_available"]) == ("cpu", "cpu", True)
    assert out["device_count"] == 2  # DeepSpeed's CPU accelerator: the ranks the launcher put on this node
    assert out["memory_allocated"] > 10 * 2**20  # a Python process with torch holds more than 10 MiB
    assert out["all_reduce_sum"] == [3.0] * 4 and out["all_reduce_avg"] == 1.5 and out["all_reduce_max"] == 2.0
    assert out["broadcast_from_1"] == 10.0
    assert out["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5]
    assert out["all_gather_object"] == ["rank0", "rank1"]
    assert out["summary_ops"] == ["all_gather", "all_reduce", "barrier", "broadcast"]  # what ran since the reset
    # counted by minizero's Communicator: three all-reduces of 16, 4 and 4 bytes
    assert out["all_reduce_bytes"] == sum(ring_bytes_sent("all_reduce", b, 2) for b in (16, 4, 4))


def test_the_script_trains_and_its_checkpoint_round_trips(launched):
    out, _ = launched
    assert out["seed_repeats"] and out["seed_same_on_ranks"]
    assert out["micro_steps"] == 24 and out["global_steps"] == 12
    assert out["batches_per_epoch"] == 6 and out["micro_steps"] > out["batches_per_epoch"]  # RepeatingLoader wrapped
    assert out["loss_last_epoch"] < 0.6 * out["loss_first_epoch"], out
    assert out["weights_equal_on_ranks"]
    assert out["client_state"] == {"step": 24}
    assert out["moved_after_save"] > 1e-4      # a step after the save changed the weights ...
    assert out["loaded_vs_saved"] == 0.0       # ... and loading the checkpoint put them back exactly


def test_pipeline_module_trains_with_train_batch(launched):
    out, _ = launched
    assert out["pipe_param_names"] == ["0.weight", "0.bias", "1.fc.weight"]  # DeepSpeed's "<layer index>." names
    assert out["pipe_last"] < 0.7 * out["pipe_first"], out


# ----------------------------------------------------------------------------- in-process checks

@pytest.mark.parametrize("path", SURFACE)
def test_import_minizero_as_deepspeed_resolves(path):
    module, _, name = ("minizero." + path).rpartition(".")
    assert getattr(importlib.import_module(module), name) is resolve(deepspeed, path)  # `from deepspeed.x import y`


def test_a_missing_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        deepspeed.nonexistent


def test_add_config_arguments_parses_deepspeeds_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args(["--deepspeed", "--deepspeed_config", "ds.json",
                                                                "--local_rank=1"])
    assert (args.deepspeed, args.deepspeed_config, args.local_rank, args.deepscale) == (True, "ds.json", 1, False)
    assert deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args([]).deepspeed is False


def test_accelerator_on_this_machine():
    acc = deepspeed.accelerator.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.device_name() == kind and acc.is_available()
    assert acc.on_accelerator(torch.zeros(1, device=kind)) and acc.device(0).type == kind
    assert 0 < acc.available_memory() <= acc.total_memory()
    if kind == "cpu":
        assert acc.current_device_name() == "cpu" and acc.device_name(3) == "cpu" and acc.device_count() == 1
        before = acc.memory_allocated()
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        assert acc.memory_allocated() - before > 32 * 2**20
        assert acc.max_memory_allocated() >= acc.memory_allocated()
        del block
    else:
        assert acc.current_device_name() == f"cuda:{torch.cuda.current_device()}"


def test_repeating_loader_starts_again():
    loader = deepspeed.utils.RepeatingLoader(torch.utils.data.DataLoader(list(range(3)), batch_size=1))
    assert [next(loader).item() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert iter(loader) is loader


def test_set_random_seed_seeds_every_generator():
    import random

    import numpy as np
    draw = lambda: (random.random(), float(np.random.rand()), torch.rand(1).item())  # noqa: E731
    deepspeed.runtime.utils.set_random_seed(7)
    first = draw()
    deepspeed.runtime.utils.set_random_seed(7)
    assert draw() == first
    deepspeed.runtime.utils.set_random_seed(8)
    assert draw() != first


def test_see_memory_usage_reports_only_when_forced(caplog):
    import logging
    logger = logging.getLogger("minizero")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="minizero"):
            deepspeed.runtime.utils.see_memory_usage("before", force=False)
            assert caplog.messages == []
            deepspeed.runtime.utils.see_memory_usage("after the model", force=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert caplog.messages[0] == "after the model" and caplog.messages[1].startswith("MA ")
    allocated_gb = float(caplog.messages[1].split()[1])
    assert allocated_gb == pytest.approx(deepspeed.accelerator.get_accelerator().memory_allocated() / 2**30, abs=0.05)


def _adam_steps(make, steps=3):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 3))
    opt = make([w])
    for i in range(steps):
        opt.zero_grad()
        ((w * (i + 1)) ** 2).sum().backward()
        opt.step()
    return w.detach()


@pytest.mark.parametrize("cls,mode_key", [("DeepSpeedCPUAdam", "adamw_mode"), ("FusedAdam", "adam_w_mode")])
def test_deepspeed_adams_are_torchs(cls, mode_key):
    ds = getattr(deepspeed.ops.adam, cls)
    kw = dict(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    assert torch.allclose(_adam_steps(lambda p: ds(p, **kw)), _adam_steps(lambda p: torch.optim.AdamW(p, **kw)),
                          atol=1e-6)
    l2 = _adam_steps(lambda p: ds(p, **kw, **{mode_key: False}))
    assert torch.allclose(l2, _adam_steps(lambda p: torch.optim.Adam(p, **kw)), atol=1e-6)
    assert not torch.allclose(l2, _adam_steps(lambda p: torch.optim.AdamW(p, **kw)), atol=1e-4)
    opt = ds([nn.Parameter(torch.zeros(1))], **{mode_key: False})
    accepted = inspect.signature(ds.__init__).parameters  # what minizero.initialize rebuilds it from
    rebuilt = ds([nn.Parameter(torch.zeros(1))], **{k: v for k, v in opt.defaults.items() if k in accepted})
    assert rebuilt.defaults["decoupled_weight_decay"] is False
    with pytest.raises(ValueError, match="amsgrad"):
        ds([nn.Parameter(torch.zeros(1))], amsgrad=True)


def test_checkpointing_checkpoint_gives_the_same_gradients():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    block(x).square().sum().backward()
    plain = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    deepspeed.checkpointing.checkpoint(block, x).square().sum().backward()
    assert all(torch.allclose(a, b) for a, b in zip(plain, [p.grad for p in block.parameters()] + [x.grad]))
    deepspeed.checkpointing.configure(None, partition_activations=False)
    assert deepspeed.checkpointing.is_configured()
    with pytest.raises(ValueError, match="partition_activations"):
        deepspeed.checkpointing.configure(None, partition_activations=True)


def test_moe_param_groups_split_as_deepspeed():
    torch.manual_seed(0)
    model = nn.ModuleDict({"dense": nn.Linear(8, 8),
                           "moe": deepspeed.moe.layer.MoE(hidden_size=8, expert=16, num_experts=4, ep_size=2)})
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 0.1, "weight_decay": 0.0})
    experts = [p for p in model.parameters() if deepspeed.moe.utils.is_moe_param(p)]
    assert len(experts) == 4 and [g.get("moe", False) for g in groups] == [False, True]
    assert groups[1]["name"] == "ep_size_2" and all(g["lr"] == 0.1 for g in groups)
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in experts}
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())
    small = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters())}], max_group_size=max(p.numel() for p in experts))
    assert len([g for g in small if g.get("moe")]) == 4  # one expert tensor per piece at that size


def test_gathered_parameters():
    w = nn.Parameter(torch.ones(3))
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        w.data.mul_(2)  # a world of one: nothing to broadcast, the edit stays
    assert w.tolist() == [2.0, 2.0, 2.0]
    with deepspeed.zero.Init():
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sharded by minizero's ZeRO-3"):
        deepspeed.zero.GatheredParameters(list(meta.parameters()))


def test_pipeline_module_maps_onto_minizeros_pipeline():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 6), deepspeed.pipe.LayerSpec(nn.Linear, 6, 6), lambda x: torch.relu(x),
              deepspeed.pipe.LayerSpec(nn.Linear, 6, 2)]
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), hidden_shape=(6,))
    parts = net.pipeline_parts()
    assert parts.embed is layers[0] and len(parts.blocks) == 2 and parts.hidden_shape == (6,)
    assert parts.head is net.get_submodule("3") and isinstance(parts.loss_fn, nn.MSELoss)
    x = torch.randn(5, 4)
    expected = parts.head(torch.relu(parts.blocks[0](parts.embed(x))))
    assert torch.equal(net(x), expected)
    # no hidden_shape: the stages learn it at the first step; the layers are cut as DeepSpeed cuts
    # them, 'parameters' balancing the trainable counts [30, 42, 0, 14]: stage 0 the first layer,
    # stage 1 the rest
    assert net.stage_parts() == [0, 1, 4] and parts.stage_blocks == [range(0, 0), range(0, 2)]
    uniform = deepspeed.pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(),
                                            partition_method="uniform")
    assert uniform.stage_parts() == [0, 2, 4] and uniform.pipeline_parts().hidden_shape is None
    assert uniform.pipeline_parts().stage_blocks == [range(0, 1), range(1, 2)]
    try:
        from deepspeed.runtime.utils import partition_balanced
    except ImportError:
        partition_balanced = None
    if partition_balanced is not None:  # the same solver and ties as DeepSpeed's, lopsided counts
        for weights, stages in (([30, 42, 0, 14], 2), ([5, 1, 1, 1, 1, 5], 3),
                                ([0, 9, 0, 0, 9, 1, 1], 2)):
            assert deepspeed.pipe._partition_balanced(weights, stages) == [
                int(p) for p in partition_balanced(weights, stages)], weights
    with pytest.raises(NotImplementedError, match="TiedLayerSpec"):
        deepspeed.pipe.TiedLayerSpec("embed", nn.Linear, 2, 2)
    with pytest.raises(ValueError, match="partition_method 'type:transformer'"):
        deepspeed.pipe.PipelineModule(layers=layers, num_stages=2, partition_method="type:transformer")
    with pytest.raises(RuntimeError, match="torch.nn.Module types"):
        deepspeed.pipe.LayerSpec(len)


def test_offload_states_checks_its_arguments_as_deepspeed_and_moves_nothing_on_cpu():
    from minizero.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    assert [e.value for e in OffloadStateTypeEnum] == [
        "optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]
    from minizero import comm as comm_mod
    ours = not comm_mod.is_initialized()  # then shut it at the end: later tests start without one
    engine = deepspeed.initialize(model=nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})[0]
    try:
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
        before = {k: v.clone() for k, v in engine.optimizer.state_dict()["state"][0].items()}
        engine.offload_states(include=[OffloadStateTypeEnum.optim_states],
                              device=OffloadDeviceEnum.cpu)
        engine.reload_states()
        after = engine.optimizer.state_dict()["state"][0]
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)  # Adam's moments as they were
        with pytest.raises(ValueError, match="include holds 'grads'; allowed: "
                                             "OffloadStateTypeEnum's optim_states, hp_params"):
            engine.offload_states(include=["grads"])
        with pytest.raises(ValueError, match="device 'nvme' is not supported"):
            engine.offload_states(device=OffloadDeviceEnum.nvme)
    finally:
        engine.destroy()
        if ours:
            comm_mod.shutdown()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_in_the_optimizer_are_held_but_not_trained(stage):
    # the model's frozen layer in optimizer= is accepted and skipped: the ledger holds every parameter but
    # gradients and Adam's moments for the 260 trainable elements only (fp32, one rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    net[0].requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    from minizero import comm as comm_mod
    ours = not comm_mod.is_initialized()
    engine = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})[0]
    try:
        engine.backward(nn.functional.cross_entropy(engine(torch.randn(2, 16)), torch.tensor([0, 1])))
        engine.step()
        held = {k: v["device"] for k, v in engine.memory().detail.items()}
        assert held["parameters"] == 4 * (16 * 64 + 64 + 64 * 4 + 4)
        assert held["gradients"] == (0 if stage == 3 else 4 * 260)  # stage 3 frees them after the step
        assert 2 * 4 * 260 <= held["optimizer_state"] <= 2 * 4 * 260 + 8  # + Adam's step counters
        assert torch.equal(net[0].weight.detach(), frozen)
    finally:
        engine.destroy()
        if ours:
            comm_mod.shutdown()


def test_comm_refuses_what_it_does_not_implement():
    from minizero.comm.deepspeed_api import _op
    assert _op(torch.distributed.ReduceOp.SUM) == "sum" and _op(deepspeed.comm.ReduceOp.AVG) == "avg"
    with pytest.raises(ValueError, match="PRODUCT"):
        _op(torch.distributed.ReduceOp.PRODUCT)
    with pytest.raises(ValueError, match="rank= and world_size="):
        deepspeed.init_distributed(rank=0, world_size=2)
    with pytest.raises(ValueError, match="dist_backend 'hccl'"):
        deepspeed.init_distributed(dist_backend="hccl")


def test_comm_before_init_distributed_names_it():
    from minizero.comm import communicator
    if communicator.is_initialized():
        pytest.skip("another test in this process started the global communicator")
    for call in (deepspeed.comm.get_rank, deepspeed.comm.get_world_size, deepspeed.comm.barrier):
        with pytest.raises(RuntimeError, match=r"call deepspeed.init_distributed\(\)"):
            call()
    assert not communicator.is_initialized()  # the check started nothing


# ----------------------------------------------------------------------------- the launcher's flags

def _ranks(argv, gpus=0):
    args = runner.parser().parse_args([*argv, "train.py"])
    errors = []

    def error(msg):
        errors.append(msg)
        raise SystemExit(2)
    try:
        return runner.ranks_and_devices(args, error, gpus)
    except SystemExit:
        return errors[0]


def test_the_scripts_own_flags_stay_the_scripts():
    args = runner.parser().parse_args(["--num_gpus", "2", "train.py", "--a", "--num_gpus", "3", "--deepspeed"])
    assert (args.num_gpus, args.user_script, args.user_args) == (2, "train.py", ["--a", "--num_gpus", "3",
                                                                                  "--deepspeed"])


def test_launcher_counts_ranks_as_deepspeed(tmp_path):
    assert _ranks([]) == (1, None) and _ranks(["--num_gpus", "3"]) == (3, None)
    assert _ranks(["--include", "localhost:0,2"]) == (2, None)
    assert _ranks([], gpus=4) == (4, [0, 1, 2, 3])
    assert _ranks(["--include", "localhost:1,3"], gpus=4) == (2, [1, 3])
    assert _ranks(["--exclude", "localhost:0"], gpus=4) == (3, [1, 2, 3])
    assert _ranks(["--num_gpus", "2"], gpus=4) == (2, [0, 1])
    assert "this machine has 4 GPUs" in _ranks(["--num_gpus", "5"], gpus=4)
    assert "--num_nodes 2" in _ranks(["--num_nodes", "2"])
    assert "give one of them" in _ranks(["--include", "localhost:0", "--num_gpus", "2"])
    assert "leaves no device" in _ranks(["--exclude", "localhost"])
    assert "names ['node7']" in _ranks(["--include", "node7:0"])
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=3\n")
    assert _ranks(["--hostfile", str(hosts)]) == (3, None)
    hosts.write_text("node1 slots=2\nnode2 slots=2\n")
    assert "names ['node1', 'node2']" in _ranks(["--hostfile", str(hosts)])


@pytest.mark.parametrize("argv,says", [
    (["--launcher", "pdsh", "x.py"], "--launcher 'pdsh': use mpirun or torchrun"),
    (["--num_gpus", "2", "missing_script.py"], "user_script missing_script.py: no such file"),
    (["--force_multi", "tests/conftest.py"], "--force_multi is a DeepSpeed launcher flag minizero does not implement"),
    (["--num_gpus", "0", "tests/outside/__init__.py"], "--num_gpus 0: give a positive number"),
    (["--enable_each_rank_log", "logs", "tests/conftest.py"], "--enable_each_rank_log is a DeepSpeed launcher flag"),
])
def test_launcher_bad_input_is_one_message_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        runner.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_against_real_deepspeed():
    try:
        real = importlib.import_module("deepspeed")
    except ImportError:
        pytest.skip(DS_INSTALL)
    for path in SURFACE:
        if path != "comm.is_initialized":
            resolve(real, path)  # every name minizero offers is DeepSpeed's
    for path in ("add_config_arguments", "comm.all_reduce", "comm.broadcast", "runtime.utils.set_random_seed"):
        ours = list(inspect.signature(resolve(deepspeed, path)).parameters)
        real_fn = resolve(real, path)  # DeepSpeed's comm calls are wrapped by its timed_op without functools.wraps
        real_fn = inspect.getclosurevars(real_fn).nonlocals.get("func", real_fn)
        theirs = list(inspect.signature(real_fn).parameters)
        assert ours[:len(theirs)] == theirs[:len(ours)], path


# ----------------------------------------------------------------------------- config keys DeepSpeed accepts

BASE = {"train_micro_batch_size_per_gpu": 2}


def test_deepspeeds_defaults_and_disabled_values_are_accepted():
    from minizero.runtime.config import load_config
    cfg = load_config({**BASE, "prescale_gradients": False, "steps_per_print": float("inf"),
                       "torch_autocast": {"enabled": False, "dtype": "bfloat16"},
                       "fp16": {"enabled": False, "fp16_master_weights_and_grads": False},
                       "bf16": {"bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
                       "zero_force_ds_cpu_optimizer": False})
    assert cfg["steps_per_print"] == float("inf")
    assert cfg["bf16"] == {"enabled": False, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    assert cfg["zero_force_ds_cpu_optimizer"] is False and load_config(BASE)["zero_force_ds_cpu_optimizer"] is True
    assert "prescale_gradients" not in cfg and "torch_autocast" not in cfg
    assert load_config(json.loads('{"train_micro_batch_size_per_gpu": 2, "steps_per_print": Infinity}'))[
        "steps_per_print"] == float("inf")


@pytest.mark.parametrize("given,says", [
    ({"prescale_gradients": True}, "'prescale_gradients': true is not implemented"),
    ({"torch_autocast": {"enabled": True}}, "'torch_autocast.enabled': true is not implemented"),
    ({"torch_autocast": {"enabeld": False}}, "keys among enabled, dtype, lower_precision_safe_modules"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "'fp16.fp16_master_weights_and_grads': true"),
    ({"bf16": {"bf16_optimizer_states": True}}, "'bf16.bf16_optimizer_states': true"),
    ({"steps_per_print": -float("inf")}, "'steps_per_print' must be"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "give one of them, not both"),
])
def test_other_values_are_refused_naming_the_key(given, says):
    from minizero.runtime.config import load_config
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, **given})
    assert says in str(e.value)


def test_deprecated_cpu_offload_is_mapped_with_deepspeeds_warning():
    from minizero.runtime.config import ConfigWarning, load_config
    with pytest.warns(ConfigWarning, match="Config parameter cpu_offload is deprecated use offload_optimizer instead"):
        cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.warns(ConfigWarning):
        cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "none"


# ----------------------------------------------------------------------------- docs/deepspeed.md's tables

DOC = os.path.join(ROOT, "docs", "deepspeed.md")
# the engine's nn.Module side, as DeepSpeedEngine (a torch.nn.Module holding `module`) gives it
MODULE_SIDE = ["module", "parameters", "named_parameters", "state_dict", "load_state_dict", "train", "eval", "to"]


def _table(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table after `heading` in docs/deepspeed.md."""
    lines = open(DOC).read().split(heading + "\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _documented_module_names() -> set:
    """`deepspeed.X` names in the module table's first column: `deepspeed.comm` (`get_rank`, ...) are the module's
    names, `deepspeed.utils.RepeatingLoader`, `logger` are siblings; call parentheses dropped."""
    names = set()
    for first, *_ in _table("## The module surface"):
        ticks = [t.split("(")[0] for t in re.findall(r"`([^`]+)`", first)]
        head = ticks[0]
        assert head.startswith("deepspeed."), first
        base = head if inspect.ismodule(resolve(deepspeed, head[len("deepspeed."):])) else head.rpartition(".")[0]
        names.add(head)
        names.update(f"{base}.{t}" for t in ticks[1:])
    return names


def test_the_docs_module_table_is_the_surface():
    names = _documented_module_names()
    assert {"deepspeed." + p for p in SURFACE} <= names, sorted({"deepspeed." + p for p in SURFACE} - names)
    for name in names:  # every documented name resolves under `import minizero as deepspeed`
        resolve(deepspeed, name[len("deepspeed."):])


def _engine():
    return deepspeed.initialize(model=nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]


def _covered_accessors(ours, engine_class) -> tuple[list, list]:
    """DeepSpeedEngine's own methods and the attributes its source sets that minizero's engine has too (not
    inherited from nn.Module alone: `compile` there is torch's, not DeepSpeed's)."""
    source = inspect.getsource(engine_class)
    plain = set(dir(nn.Module))
    have = {n for n in dir(ours) if not n.startswith("_")}
    methods = sorted(n for n in vars(engine_class) if not n.startswith("_") and n in have and n not in MODULE_SIDE
                     and not (n in plain and getattr(type(ours), n) is getattr(nn.Module, n)))
    attrs = sorted(n for n in set(re.findall(r"self\.([a-z][a-z0-9_]*) = ", source)) & have
                   if n not in vars(engine_class) and n not in MODULE_SIDE)
    return methods, attrs


def test_the_docs_engine_table_lists_every_accessor_covered():
    from minizero import comm as comm_mod
    rows = {group: re.findall(r"`([^`(]+)`", names) for group, names in _table("## The engine's DeepSpeed accessors")}
    assert rows["`nn.Module`"] == MODULE_SIDE
    engine = _engine()
    try:
        for name in [n for names in rows.values() for n in names]:
            assert hasattr(engine, name), name
        try:
            from deepspeed.runtime.engine import DeepSpeedEngine
        except ImportError:
            return  # the rows exist on minizero's engine; which of DeepSpeed's are covered needs DeepSpeed
        methods, attrs = _covered_accessors(engine, DeepSpeedEngine)
        expected = {"`nn.Module`": MODULE_SIDE, "methods": methods, "attributes": attrs}
        assert rows == expected, "\n".join(f"| {k} | {', '.join(f'`{n}`' for n in v)} |" for k, v in expected.items())
    finally:
        engine.destroy()
        if comm_mod.is_initialized():
            comm_mod.shutdown()


def refused_key_rows() -> list[list[str]]:
    """docs/deepspeed.md's refused-keys table, from runtime/config.py's lists."""
    from minizero.runtime import config as c
    rows = [[f"`{k}`", "none: remove it", why] for k, why in c.NOT_IMPLEMENTED.items()]
    rows += [[f"`{k}`", f"`{json.dumps(v)}` (DeepSpeed's default)", why] for k, (v, why) in c.AT_DEFAULT_ONLY.items()]
    rows += [[f"`{k}`", '`{"enabled": false}`', instead] for k, (_, instead) in c.DISABLED_SECTIONS.items()]
    defaults = c.SCHEMA["activation_checkpointing"]
    rows += [[f"`activation_checkpointing.{k}`", f"`{json.dumps(defaults[k])}` (DeepSpeed's default)",
              f"not implemented: in DeepSpeed it means {why}"] for k, why in c.CHECKPOINTING_NOT_IMPLEMENTED.items()]
    return rows


def test_the_docs_refused_keys_table_is_the_configs():
    expected = refused_key_rows()
    assert _table("## Config keys refused, and why") == expected, "\n".join("| " + " | ".join(r) + " |"
                                                                             for r in expected)


def test_an_engine_trains_after_another_was_destroyed():
    # Accelerate's cross_validation.py prepares a new model per fold and frees the last
    # (free_memory destroys its engine): the next engine's backward must not reach the old one
    from minizero import comm as comm_mod
    ours = not comm_mod.is_initialized()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engines = []
    try:
        for fold in range(2):
            torch.manual_seed(fold)
            net = nn.Linear(4, 2)
            engine = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)[0]
            engines.append(engine)
            before = net.weight.detach().clone()
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
            assert not torch.equal(net.weight.detach(), before), f"fold {fold} did not train"
            engine.destroy()
    finally:
        if ours:
            comm_mod.shutdown()
