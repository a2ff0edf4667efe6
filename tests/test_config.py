"""DeepSpeed-config validation: typos, unimplemented DeepSpeed keys, "auto", the batch triple."""
import json
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
    with pytest.raises(ConfigError, match="'activation_checkpointing' is a DeepSpeed key minizero does not implement: use torch.utils.checkpoint"):
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
