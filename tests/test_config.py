"""DeepSpeed-config validation: typos, unimplemented DeepSpeed keys, "auto", the batch triple."""
import re
from pathlib import Path

import pytest

from minizero.runtime.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT.parent / "shared" / "seeds" / "001_361a2ac1204903b1.txt"


def test_defaults_are_filled_and_batch_derived():
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=3)
    assert cfg["train_batch_size"] == 24
    assert cfg["zero_optimization"]["stage"] == 0 and cfg["zero_optimization"]["overlap_comm"] is False
    assert cfg["fp16"]["initial_scale_power"] == 16 and cfg["optimizer"] is None
    assert cfg["gradient_clipping"] == 1.0  # DeepSpeed's default: a config without the key clips
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=4)
    assert cfg["gradient_accumulation_steps"] == 2
    cfg = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=4)
    assert cfg["train_micro_batch_size_per_gpu"] == 4


def test_batch_mismatch_uses_deepspeed_wording():
    with pytest.raises(ConfigError, match=re.escape(
            "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 32 != 4 * 2 * 2")):
        load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 2}, world_size=2)
    with pytest.raises(ConfigError, match="not divisible"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=4)


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config({"train_batch_size": 8, "zero_optimization": {"stgae": 2}})
    msg = str(e.value)
    assert "unknown config key 'zero_optimization.stgae'" in msg and "Did you mean 'stage'" in msg
    assert "reduce_bucket_size" in msg  # the valid keys at that level are listed


def test_real_deepspeed_key_not_implemented_is_an_error_saying_what_to_do():
    with pytest.raises(ConfigError,
                       match="'flops_profiler' is a DeepSpeed key minizero does not implement: use torch.profiler"):
        load_config({"train_batch_size": 8, "flops_profiler": {"enabled": True}})
    with pytest.raises(ConfigError, match="'activation_checkpointing.partition_activations': True is not implemented"):
        load_config({"train_batch_size": 8, "activation_checkpointing": {"partition_activations": True}})
    with pytest.raises(ConfigError, match="zero_optimization.round_robin_gradients"):
        load_config({"train_batch_size": 8, "zero_optimization": {"round_robin_gradients": True}})


def test_auto_resolves_to_documented_defaults():
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
                      world_size=2)
    assert cfg["train_batch_size"] == 4 and cfg["gradient_clipping"] == 1.0
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 5e8 and cfg["zero_optimization"]["overlap_comm"] is True
    with pytest.raises(ConfigError, match="does not accept \"auto\""):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": "auto"}})


def test_bad_combinations():
    with pytest.raises(ConfigError, match="cannot be combined with pipeline"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}})
    with pytest.raises(ConfigError, match="choose one"):
        load_config({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="nvme_path"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(ConfigError, match="Adam, AdamW, SGD"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "Lamb"}})


def test_seed_001_config_loads_as_it_is(tmp_path):
    path = ROOT / "configs" / "ds_config_seed001.json"
    if SEED.exists():  # the committed copy is the seed article's block, byte for byte
        block = re.search(r"```json\n(.*?)```", SEED.read_text(), re.S).group(1)
        assert path.read_text() == block
    from minizero.runtime.config import ConfigWarning
    with pytest.warns(ConfigWarning, match="stage3_gather_16bit_weights_on_model_save"):
        cfg = load_config(str(path), world_size=4)
    assert cfg["train_batch_size"] == 32 and cfg["gradient_accumulation_steps"] == 2
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["reduce_bucket_size"] == 5e8
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["fp16"]["hysteresis"] == 2
    with pytest.raises(ConfigError, match="not equal"), pytest.warns(ConfigWarning):
        load_config(str(path), world_size=2)


def test_look_alike_key_from_the_seed_is_explained():
    with pytest.raises(ConfigError, match="offload_gradients': DeepSpeed has no such key"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_gradients": {"device": "cpu"}}})


def test_keys_without_effect_warn_when_changed():
    from minizero.runtime.config import ConfigWarning
    with pytest.warns(ConfigWarning, match="'zero_optimization.stage3_max_reuse_distance': 1000 has no effect"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1000}})
    # sub_group_size means something only for the disk tier
    with pytest.warns(ConfigWarning, match="sub_group_size.*only with offload_optimizer.device 'nvme'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": 1000}})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": 1e9}})


@pytest.mark.parametrize("section, key, value, kind", [
    ("fp16", "enabled", "false", "a boolean (true or false)"),   # trained in fp16 before: "false" is truthy
    ("bf16", "enabled", "false", "a boolean (true or false)"),
    ("zero_optimization", "overlap_comm", "false", "a boolean (true or false)"),
    (None, "gradient_clipping", "1.0", "a number"),                # passed initialize, TypeError at step 1
    (None, "train_micro_batch_size_per_gpu", 2.5, "an integer or null"),
    (None, "steps_per_print", True, "an integer"),                # JSON true is no number
    ("zero_optimization", "stage", "2", "an integer"),
    ("zero_optimization", "reduce_bucket_size", [1], "an integer"),
    ("fp16", "initial_scale_power", 16.5, "an integer"),
    ("optimizer", "type", 3, "a string"),
])
def test_every_value_is_type_checked_naming_key_type_and_value(section, key, value, kind):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    path = f"{section}.{key}" if section else key
    if section:
        cfg.setdefault(section, {})[key] = value
    else:
        cfg[key] = value
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert str(e.value) == f"'{path}' must be {kind}, got {value!r} ({type(value).__name__})"


def test_optimizer_params_ranges_and_deepspeed_floats():
    with pytest.raises(ConfigError, match=r"'optimizer.params.lr' must be a number, got '1e-3' \(str\)"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}})
    with pytest.raises(ConfigError, match="'optimizer.params.betas' must be a list of two numbers"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": 0.9}}})
    with pytest.raises(ConfigError, match="'zero_optimization.reduce_bucket_size' must be more than 0, got 0"):
        load_config({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 0}})
    with pytest.raises(ConfigError, match="'gradient_clipping' must be at least 0, got -1"):
        load_config({"train_batch_size": 8, "gradient_clipping": -1})
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 2e8, "stage": 2.0}})
    zero = cfg["zero_optimization"]
    assert zero["reduce_bucket_size"] == 200_000_000 and type(zero["stage"]) is int


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("bad", [{"fp16": {"enabled": True, "initial_scale_power": -100}},
                                 {"fp16": {"enabled": True, "loss_scale_window": 0}},
                                 {"fp16": {"enabled": "false"}}, {"gradient_clipping": "1.0"},
                                 {"zero_optimization": {"stage3_param_persistence_threshold": -1}}])
def test_a_config_error_leaves_the_model_untouched(stage, bad, monkeypatch):
    """Everything is checked before the model is cast, wrapped or sharded, and before any collective
    (initialize must raise before it asks for a communicator: none may exist in the pytest process)."""
    import torch

    from minizero import comm as comm_mod
    from minizero.models import build_model
    from minizero.runtime.engine import build_engine

    def refuse(*a, **k):
        raise AssertionError("a communicator was requested before the config was checked")
    monkeypatch.setattr(comm_mod, "init", refuse)
    monkeypatch.setattr(comm_mod, "get", refuse)
    model = build_model("tiny-gpt", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg.update(bad)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": stage}
    with pytest.raises(ConfigError):
        build_engine(model, cfg)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and len(list(model.parameters())) == 29
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_pipeline_section():
    base = {"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2, "micro_batches": 4}}
    cfg = load_config(base, world_size=4)
    # DeepSpeed: the micro-batches are the accumulation steps, and the batch counts dp = world / stages
    assert cfg["gradient_accumulation_steps"] == cfg["pipeline"]["micro_batches"] == 4
    assert cfg["train_batch_size"] == 2 * 4 * 2 and cfg["pipeline"]["schedule"] == "1f1b"
    assert load_config({**base, "train_batch_size": 16, "gradient_accumulation_steps": 4}, world_size=4)
    with pytest.raises(ConfigError, match=r"train_batch_size is not equal to .* 32 != 2 \* 4 \* 2"):
        load_config({**base, "train_batch_size": 32, "gradient_accumulation_steps": 4}, world_size=4)
    with pytest.raises(ConfigError,
                       match="pipeline.stages = 3 x tensor_parallel.autotp_size = 1 does not divide the world size 4"):
        load_config({**base, "pipeline": {"stages": 3}}, world_size=4)
    with pytest.raises(ConfigError, match="valid schedules: gpipe, 1f1b, interleaved_1f1b, zb_h1"):
        load_config({**base, "pipeline": {"stages": 2, "schedule": "pipedream"}}, world_size=4)
    with pytest.raises(ConfigError, match="interleaved_1f1b needs chunks >= 2"):
        load_config({**base, "pipeline": {"stages": 2, "chunks": 2}}, world_size=4)
    with pytest.raises(ConfigError, match="micro_batches = 4 but gradient_accumulation_steps = 2"):
        load_config({**base, "gradient_accumulation_steps": 2}, world_size=4)
    for stage in (2, 3):  # refused, with the reason
        with pytest.raises(ConfigError, match=rf"stage {stage} cannot be combined with pipeline parallelism.*"
                                              r"accumulates every micro-batch's gradient.*4x the gradient traffic.*"
                                              r"Use stage 0 or 1"):
            load_config({**base, "zero_optimization": {"stage": stage}}, world_size=4)
    assert load_config({**base, "zero_optimization": {"stage": 1}}, world_size=4)["zero_optimization"]["stage"] == 1


def test_pipeline_engine_refuses_what_it_cannot_do_before_any_collective():
    import minizero
    from minizero.models import MLP, GPTConfig, TinyGPT
    cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "pipeline": {"stages": 2}}
    with pytest.raises(ConfigError, match="bf16 with pipeline.stages > 1: not available"):
        minizero.initialize(model=TinyGPT(), config={**cfg, "bf16": {"enabled": True}}, comm=_FakeComm(2))
    with pytest.raises(ConfigError, match="offload_optimizer.device 'cpu' with pipeline.stages > 1: not available"):
        minizero.initialize(model=TinyGPT(),
                            config={**cfg, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
                            comm=_FakeComm(2))
    # 3D (pipeline x tensor parallel): what cannot work is refused before the mesh is built
    tp = {**cfg, "train_batch_size": 4, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ConfigError, match="sequence_parallel with pipeline.stages > 1: not implemented"):
        minizero.initialize(model=TinyGPT(),
                            config={**tp, "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}},
                            comm=_FakeComm(4))
    with pytest.raises(ConfigError, match="splits a nanoGPT-named model.*MLP has no wte"):
        minizero.initialize(model=MLP(), config=tp, comm=_FakeComm(4))
    with pytest.raises(ValueError, match="n_head=3 is not divisible by the tensor-parallel size 2"):
        minizero.initialize(model=TinyGPT(GPTConfig(n_head=3, n_embd=48)), config=tp, comm=_FakeComm(4))
    with pytest.raises(ConfigError, match="4 pipeline stages .* only 2 blocks"):  # a ConfigError: train says it once
        minizero.initialize(model=TinyGPT(), config={**tp, "train_batch_size": 2, "pipeline": {"stages": 4}},
                            comm=_FakeComm(8))
    with pytest.raises(ConfigError, match="needs a model cut into stages.*got a MLP"):
        minizero.initialize(model=MLP(), config=cfg, comm=_FakeComm(2))


class _FakeComm:
    """A communicator that must never be used: the checks run before any collective."""

    def __init__(self, size):
        self.size = size

    def __getattr__(self, name):
        raise AssertionError(f"a collective ({name}) ran before the config was checked")
