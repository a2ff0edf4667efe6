"""The engine is an nn.Module wrapping the user's model, with DeepSpeed's accessors and checkpoint signatures
(deepspeed/runtime/engine.py: DeepSpeedEngine is a torch.nn.Module holding `module`; save_checkpoint /
load_checkpoint keywords; load_checkpoint returns (None, None) with a warning when there is no `latest`).
In this process, on a world of one (no launch): the Module surface does not depend on the world size."""
import os
import warnings

import pytest
import torch

import minizero
from minizero.models import build_model

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _config(stage=0, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            "zero_optimization": {"stage": stage}, **extra}


@pytest.fixture
def world_of_one():
    from minizero import comm as comm_mod
    assert not comm_mod.is_initialized()
    yield
    comm_mod.shutdown()


def _state(engine) -> list:
    """Adam's exp_avg and exp_avg_sq of this rank's shard, flattened (ZeRO-1's inner torch optimizer)."""
    st = list(engine.optimizer.optim.state.values())
    return [torch.cat([s[k].reshape(-1) for s in st]) for k in ("exp_avg", "exp_avg_sq")] if st else []


def _train(engine, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=g).to(engine.device)  # your batch to the engine's device
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_is_a_module_around_the_users_model(world_of_one, stage):
    model = build_model("tiny-gpt", seed=0, **GPT)
    names = [n for n, _ in model.named_parameters()]
    engine, *_ = minizero.initialize(model=model, config=_config(stage, bf16={"enabled": stage == 1}))
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]
    assert list(engine.state_dict()) == [f"module.{k}" for k in model.state_dict()]  # each tensor once
    if stage < 3:  # ZeRO-3 replaced the parameters by this rank's shards (as DeepSpeed's partitioned ones)
        assert [n for n, _ in model.named_parameters()] == names
    assert engine.eval() is engine and not engine.training and not model.training
    assert engine.train() is engine and engine.training and model.training
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, stage == 1)
    assert (engine.zero_optimization(), engine.zero_optimization_stage()) == (stage > 0, stage)
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.mp_world_size) == (0, 1, 1, 1)
    assert engine.local_rank == 0 and engine.gradient_clipping() == 1.0 and engine.steps_per_print() == 10
    assert engine.get_mom() == [(0.9, 0.999)] and engine.zero_offload_optimizer() is None
    assert engine.get_lr() == [0.0]  # WarmupLR: steps 1 and 2 run at lr 0, as in DeepSpeed
    losses = _train(engine, 6)
    assert losses[-1] < losses[0] and engine.global_steps == 6 and engine.get_lr()[0] > 0


def test_checkpoint_keywords_as_deepspeed(world_of_one, tmp_path):
    engine, *_ = minizero.initialize(model=build_model("tiny-gpt", seed=0, **GPT), config=_config(1))
    with pytest.warns(UserWarning, match="no 'latest' file.*nothing was loaded"):
        assert engine.load_checkpoint(str(tmp_path / "none")) == (None, None)
    _train(engine, 2)
    first = engine.save_checkpoint(str(tmp_path), client_state={"epoch": 1})
    assert open(tmp_path / "latest").read() == "global_step2"
    _train(engine, 2, seed=1)
    engine.save_checkpoint(str(tmp_path), save_latest=False)  # global_step4 written, `latest` unchanged
    assert open(tmp_path / "latest").read() == "global_step2" and (tmp_path / "global_step4").is_dir()
    state = _state(engine)

    # weights only (a warm start): counters, scheduler and optimizer state stay this engine's
    fresh, *_ = minizero.initialize(model=build_model("tiny-gpt", seed=1, **GPT), config=_config(1))
    path, client = fresh.load_checkpoint(str(tmp_path), load_module_only=True)
    assert path == first and client == {"epoch": 1}
    assert fresh.global_steps == 0 and fresh.lr_scheduler.last_batch_iteration == -1 and not fresh.optimizer.optim.state
    full = engine.full_state_dict()
    again, *_ = minizero.initialize(model=build_model("tiny-gpt", seed=0, **GPT), config=_config(1))
    again.load_checkpoint(str(tmp_path), tag="global_step4")
    assert all(torch.equal(full[k], v) for k, v in again.full_state_dict().items())
    assert again.global_steps == 4 and len(state) == 2 and all(torch.equal(a, b) for a, b in zip(state, _state(again)))

    # load_optimizer_states=False keeps this engine's (empty) optimizer state; the scheduler is loaded
    other, *_ = minizero.initialize(model=build_model("tiny-gpt", seed=0, **GPT), config=_config(1))
    other.load_checkpoint(str(tmp_path), tag="global_step4", load_optimizer_states=False)
    assert not other.optimizer.optim.state and other.global_steps == 4 and other.lr_scheduler.last_batch_iteration == 3

    for kw, words in (({"load_module_strict": False}, "load_module_strict=False"),
                      ({"custom_load_fn": print}, "custom_load_fn")):
        with pytest.raises(NotImplementedError, match=words):
            other.load_checkpoint(str(tmp_path), **kw)
    with pytest.raises(NotImplementedError, match="exclude_frozen_parameters"):
        other.save_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert other.module_state_dict().keys() == other.module.state_dict().keys()
    assert os.path.isdir(tmp_path / "global_step2")


def test_sparse_attention_section_runs_the_layout_through_the_engine(world_of_one):
    """DeepSpeed's sparse_attention section: every attention of the model runs the layout (minizero/sparse/);
    the engine's first loss equals the same model with apply_sparse_attention by hand, and differs from dense."""
    from minizero.runtime.config import ConfigError
    from minizero.sparse import apply_sparse_attention, from_section
    section = {"mode": "fixed", "block": 4, "num_local_blocks": 2, "num_global_blocks": 1,
               "attention": "unidirectional"}
    engine, *_ = minizero.initialize(model=build_model("tiny-gpt", seed=0, **GPT),
                                     config=_config(0, sparse_attention=section))
    layouts = [m.sparse_attention for m in engine.module.modules() if hasattr(m, "sparse_attention")]
    assert len(layouts) == GPT["n_layer"] and all(c == from_section(section, GPT["n_head"]) for c in layouts)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).to(engine.device)
    by_hand, dense = (build_model("tiny-gpt", seed=0, **GPT).to(engine.device) for _ in range(2))
    apply_sparse_attention(by_hand, from_section(section, GPT["n_head"]))
    loss = engine(x, x).item()
    assert loss == pytest.approx(by_hand(x, x)[1].item(), rel=1e-6) and loss != pytest.approx(dense(x, x)[1].item())
    for bad, words in (({**section, "attention": "bidirectional"}, "unidirectional"),
                       ({**section, "num_sliding": 2}, "num_sliding"),
                       ({**section, "mode": "nope"}, "mode")):
        with pytest.raises(ConfigError, match=words):
            minizero.initialize(model=build_model("tiny-gpt", seed=0, **GPT), config=_config(0, sparse_attention=bad))


def test_onebit_adam_is_refused_where_deepspeed_and_minizero_do_not_run_it():
    from minizero.runtime.config import ConfigError
    from minizero.runtime.resolve import resolve
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10, "cuda_aware": False,
                                            "comm_backend_name": "nccl"}}
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": opt}
    assert resolve({**base, "zero_optimization": {"stage": 0}}, 4).optimizer_kwargs["freeze_step"] == 10
    for extra, words in (({"zero_optimization": {"stage": 1}}, "stage > 0"), ({"fp16": {"enabled": True}}, "fp16"),
                         ({"tensor_parallel": {"autotp_size": 2}}, "autotp_size")):
        with pytest.raises(ConfigError, match=f"OneBitAdam' with .*{words}"):
            resolve({**base, **extra}, 4)
    with pytest.raises(ConfigError, match="comm_backend_name"):
        resolve({**base, "optimizer": {**opt, "params": {**opt["params"], "comm_backend_name": "gloo"}}}, 4)
