"""Activation checkpointing (minizero/activation_checkpointing.py, the engine's section).

In one process: a checkpointed TinyGPT gives the same gradients bit for bit, and the bytes autograd
keeps (memory.SavedTensors, the real saved storages) drop to one block input per block: one more
block adds exactly s·b·h·4 bytes (memory.activation_bytes(checkpointing=True)). The planner's shared
2-rank launch (tests/planner_job.py): the engine with the section, at every ZeRO stage, under TP with
and without SP, and two shapes, ends with the same parameters as without it (bitwise), sends the same
bytes without TP (a ZeRO-3 recompute gathers its unit in place of backward's gather; under TP the
recompute repeats the block's forward collectives), recomputes every block once per forward, and keeps
fewer activation bytes.
"""
import pytest
import torch

from minizero import memory
from minizero.activation_checkpointing import (checkpoint_blocks, checkpointed, repeated_blocks,
                                               uncheckpoint_blocks)
from minizero.data import SyntheticTokens
from minizero_course.experiments.planner import SHAPES, configurations
from minizero.models import GPTConfig, TinyGPT, build_model
from minizero.runtime.config import ConfigError, load_config
from minizero.runtime.engine import build_engine
from tests.planner_job import results

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

B, T, C = 2, 16, 32


def _step(model, checkpoint):
    (checkpoint_blocks if checkpoint else uncheckpoint_blocks)(model)
    x, y = SyntheticTokens(64, T).batch(0, B)
    meter = memory.SavedTensors(exclude=list(model.parameters()))
    with meter.hooks():
        loss = model(x, y)[1]
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads, meter.peak, meter.live


def test_checkpointed_model_has_the_same_gradients_and_keeps_one_input_per_block():
    peaks = {}
    for layers in (2, 3):
        model = TinyGPT(GPTConfig(n_layer=layers, n_head=2, n_embd=C, block_size=T))
        loss, grads, plain, _ = _step(model, False)
        loss_c, grads_c, ckpt, live = _step(model, True)
        assert loss_c == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_c))
        assert live == 0  # backward freed what the forward kept
        assert {k: f.recomputes for k, f in checkpointed(model).items()} == {f"h.{i}": 1 for i in range(layers)}
        peaks[layers] = plain, ckpt
    one_block_plain = peaks[3][0] - peaks[2][0]
    one_block_ckpt = peaks[3][1] - peaks[2][1]
    assert one_block_ckpt == memory.activation_bytes(B, T, C, 1, 2, bytes_per=4, checkpointing=True) == B * T * C * 4
    assert one_block_plain > 10 * one_block_ckpt  # q, k, v, the MLP's 4C inputs, the attention matrix...
    assert peaks[3][1] < peaks[3][0] / 3


def test_selective_keeps_the_linear_outputs_and_drops_the_attention_scores():
    """Per layer, measured against Korthikanti's formulas (fp32, no dropout) plus the ledger's known extras
    (experiments.tensor.unmodelled_bytes: LayerNorm statistics, and the causal mask unless recomputed)."""
    from minizero_course.experiments.tensor import unmodelled_bytes
    model = TinyGPT(GPTConfig(n_layer=2, n_head=2, n_embd=C, block_size=T))
    x, y = SyntheticTokens(64, T).batch(0, B)
    saved, grads = {}, {}
    for mode in ("none", "selective", "full"):
        uncheckpoint_blocks(model)
        if mode != "none":
            checkpoint_blocks(model, granularity=mode)
        with memory.SavedTensors({"h.0": model.h[0]}, exclude=model) as meter:
            loss = model(x, y)[1]
        loss.backward()
        saved[mode], grads[mode] = meter.bytes["h.0"], [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        if mode == "selective":
            assert {k: f.recomputes for k, f in checkpointed(model).items()} == {"h.0.attn": 1, "h.1.attn": 1}
    formula = {m: memory.activation_bytes(B, T, C, 1, 2, bytes_per=4, dropout=False, checkpointing=c)
               for m, c in (("none", False), ("selective", "selective"), ("full", "full"))}
    mask = T * T  # the boolean causal mask, made inside the core attention: recomputed under selective
    assert saved["none"] == formula["none"] + unmodelled_bytes(T, B)
    assert saved["selective"] == formula["selective"] + unmodelled_bytes(T, B) - mask
    assert formula["selective"] == 16 * 4 * B * T * C  # 34·s·b·h at w = 2 with dropout; 16·w·s·b·h without
    s, h, a = 2048, 12288, 96  # the paper's form for its own layer (bf16, dropout): 34 + 5as/h, 34, 2 (× s·b·h)
    assert [memory.activation_bytes(1, s, h, 1, a, checkpointing=c) / (s * h) for c in (False, "selective", True)] \
        == [34 + 5 * a * s / h, 34, 2]
    assert saved["full"] == formula["full"]
    assert all(torch.equal(a, b) for m in ("selective", "full") for a, b in zip(grads["none"], grads[m]))
    uncheckpoint_blocks(model)
    assert checkpointed(model) == {} and "core_attention" not in model.h[0].attn.__dict__
    with pytest.raises(ValueError, match="granularity 'partial'"):
        checkpoint_blocks(model, granularity="partial")
    with pytest.raises(ValueError, match="core_attention"):
        checkpoint_blocks(build_model("mlp"), ["layers.0"], granularity="selective")


def test_checkpointing_can_be_undone_and_names_stay():
    model = TinyGPT(GPTConfig(n_layer=2, n_head=2, n_embd=C, block_size=T))
    keys = list(model.state_dict())
    assert checkpoint_blocks(model) == repeated_blocks(model) == ["h.0", "h.1"]
    assert list(model.state_dict()) == keys and "forward" in vars(model.h[0])
    uncheckpoint_blocks(model)
    assert checkpointed(model) == {} and "forward" not in vars(model.h[0])
    with pytest.raises(ValueError, match="no submodule 'h.7'"):
        checkpoint_blocks(model, ["h.0", "h.7"])
    assert checkpointed(model) == {}  # nothing changed by the refused call


def test_config_section_keys_have_deepspeeds_meaning_or_are_refused():
    base = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert load_config(base)["activation_checkpointing"] is None
    on = load_config({**base, "activation_checkpointing": {"partition_activations": False}})
    assert on["activation_checkpointing"]["cpu_checkpointing"] is False
    for key, value in (("partition_activations", True), ("cpu_checkpointing", True),
                       ("contiguous_memory_optimization", True), ("number_checkpoints", 4),
                       ("synchronize_checkpoint_boundary", True), ("profile", True)):
        with pytest.raises(ConfigError, match=f"activation_checkpointing.{key}.*not implemented"):
            load_config({**base, "activation_checkpointing": {key: value}})
    with pytest.raises(ConfigError, match="unknown config key 'activation_checkpointing.partition'"):
        load_config({**base, "activation_checkpointing": {"partition": True}})
    model = build_model("edge")
    with pytest.raises(ConfigError, match="activation_checkpointing: EdgeCaseModel has no nn.ModuleList"):
        build_engine(model, {**base, "activation_checkpointing": {}}, comm=_OneRank())


class _OneRank:  # initialize refuses before any collective: only the size is read
    size = 1


def _pairs():
    """(plain, checkpointed) results of the shared planner job, per shape and ZeRO stage."""
    runs = {}
    for i, c in enumerate(configurations()):
        if not c.get("offload"):
            key = (c["shape"], c["zero"], c.get("tp", 1), c.get("sp", False))
            runs.setdefault(key, [None, None])[c.get("checkpointing", False)] = i
    return runs


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_engine_with_the_section_trains_bitwise_like_without(zero):
    pairs = [(key, ij) for key, ij in _pairs().items() if key[1] == zero]
    assert pairs and (zero != 1 or any(tp > 1 for (_, _, tp, _), _ in pairs))  # ZeRO-1 also under TP (+SP)
    for (shape, _, tp, sp), (plain_i, ckpt_i) in pairs:
        for rank, per_rank in enumerate(results()):
            plain, ckpt = per_rank[plain_i]["measured"], per_rank[ckpt_i]["measured"]
            where = f"shape {shape} ZeRO-{zero} tp {tp}{' SP' if sp else ''} rank {rank}"
            assert ckpt["params_sha256"] == plain["params_sha256"], f"{where}: parameters differ"
            assert plain["recomputes"] == {}
            steps = 2 * per_rank[ckpt_i]["config"]["micro_batches"]  # every forward recomputed once
            assert ckpt["recomputes"] == {f"h.{i}": steps for i in range(SHAPES[shape]["n_layer"])}, where
            if tp == 1:  # a ZeRO-3 recompute gathers in place of backward's gather: the same bytes
                assert ckpt["sent"] == plain["sent"] > 0, where
            else:  # the recompute repeats the block's forward collectives (how many: test_planner_validation)
                assert ckpt["sent"] > plain["sent"] > 0, where
            if zero != 3:  # ZeRO-3: its own saved-tensor hooks are innermost, a meter outside sees nothing
                assert 0 < ckpt["activations"] < plain["activations"] / 3, where
