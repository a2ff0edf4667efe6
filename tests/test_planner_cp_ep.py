"""The planner's context (cp) and expert (ep) parallelism: what a rank holds and sends, checked against the
mechanisms' own modules and byte formulas (tests/test_context.py and tests/test_moe.py measure those
formulas with comm.stats), `plan --fit` choosing cp for a long sequence, and the flags' errors. In-process."""
import math

import pytest

from minizero.cli.plan import main
from minizero.context import ring_bytes_per_layer, ulysses_bytes_per_layer
from minizero.moe import Experts, MoELayer, all_to_all_bytes, capacity
from minizero.planner import HARDWARE, ModelShape, ParallelStrategy, fit, plan
from minizero.planner.fit import candidates

LONG = ModelShape(layers=2, hidden=64, heads=4, seq=256, vocab=128)
MOE = ModelShape(layers=2, hidden=32, heads=4, seq=64, vocab=128, experts=8, top_k=2, capacity_factor=1.0)


def test_cp_and_ep_of_one_change_nothing():
    for kw in ({"world": 8, "zero": 1}, {"world": 8, "tp": 2, "pp": 2, "micro_batches": 4, "sp": True}):
        assert plan(LONG, ParallelStrategy(**kw, cp=1, ep=1)).as_dict() == plan(LONG, ParallelStrategy(**kw)).as_dict()
    assert ModelShape(2, 64, 4, 256, 128, experts=0).num_params() == LONG.num_params()


def test_cp_holds_the_activations_of_s_over_cp_tokens():
    """cp ranks each hold s/cp tokens: the activations are those of a model whose sequence is s/cp."""
    short = ModelShape(LONG.layers, LONG.hidden, LONG.heads, LONG.seq // 4, LONG.vocab)
    def act(shape, **kw):
        return plan(shape, ParallelStrategy(8, micro_batch=2, **kw)).stages[0].memory["activations"]
    assert act(LONG, cp=4) == act(short, cp=1) <= act(LONG) / 4
    # the parameters are replicated over cp and reduced over dp x cp: ZeRO-3 shards them 8 ways either way
    with_cp, without = (plan(LONG, ParallelStrategy(8, cp=cp, zero=3)).stages[0].memory for cp in (4, 1))
    assert {k: v for k, v in with_cp.items() if k != "activations"} == pytest.approx(
        {k: v for k, v in without.items() if k != "activations"})


@pytest.mark.parametrize("ulysses", [False, True])
def test_cp_sends_the_mechanisms_bytes_per_layer(ulysses):
    """b=2, s=256, h=64, bf16, cp=4, 2 layers, 3 micro-batches. Ring: (cp-1) blocks forward, (2cp-1) backward,
    each 2·b·(s/cp)·h·w; Ulysses: 8 all-to-alls of (cp-1)/cp·b·(s/cp)·h·w: the formulas tests/test_context.py
    measures (ring_bytes_per_layer, ulysses_bytes_per_layer)."""
    s = ParallelStrategy(8, node_size=4, cp=4, ulysses=ulysses, micro_batch=2, micro_batches=3)
    block = 2 * 2 * (256 // 4) * 64 * 2
    per_layer = 8 * 3 / 4 * block / 2 if ulysses else (3 + 7) * block
    layer = (ulysses_bytes_per_layer if ulysses else ring_bytes_per_layer)(2, 256, 64, 4, 2)
    assert per_layer == layer["forward"] + layer["backward"]
    stage = plan(LONG, s).stages[0]
    assert stage.sent["cp"] == 3 * 2 * per_layer
    assert stage.link["cp"] == "intra-node" and stage.link["dp"] == "cross-node"  # cp 4 x dp 2 on nodes of 4
    ckpt = plan(LONG, ParallelStrategy(8, cp=4, ulysses=ulysses, micro_batch=2, micro_batches=3, checkpointing=True))
    assert ckpt.stages[0].sent["cp"] == 3 * 2 * (per_layer + layer["forward"])  # the recompute's forward again


def test_ep_holds_e_over_ep_experts_and_sends_the_all_to_alls():
    """Parameters from minizero.moe's own modules; bytes 4 all-to-alls per MoE layer and micro-batch of
    (ep-1)/ep·E·C·d·w, C = ceil(k·T·cf/E) (the formula tests/test_moe.py measures)."""
    h = MOE.hidden
    moe_layer = sum(p.numel() for p in MoELayer(h, 4 * h, MOE.experts).parameters())
    assert MOE.block_params() == 12 * h * h + 13 * h - (8 * h * h + 5 * h) + moe_layer
    local = sum(p.numel() for p in Experts(MOE.experts, h, 4 * h, ep_rank=0, ep_size=4).parameters())
    dense = plan(MOE, ParallelStrategy(8, ep=1)).stages[0].params
    assert dense == MOE.num_params()
    sharded = plan(MOE, ParallelStrategy(8, ep=4, micro_batch=2, micro_batches=3))
    assert dense - sharded.stages[0].params == MOE.layers * (moe_layer - MOE.hidden * MOE.experts - local)
    slots = math.ceil(2 * (2 * 64) * 1.0 / 8)  # k T cf / E, T = b·s = 128 tokens
    assert slots == capacity(2 * 64, 8, 2, 1.0)
    one = 3 / 4 * 8 * slots * h * 2
    assert one == all_to_all_bytes(8, slots, h, 2, 4)
    st = sharded.stages[0]
    assert st.sent["ep"] == 3 * MOE.layers * 4 * one and st.link["ep"] == "intra-node"
    # the experts' gradients: all-reduced over the dp/ep = 2 ranks holding the same experts (DDP: 2·f·Ψ·w)
    assert st.sent["expert_dp"] == 2 * (1 / 2) * MOE.layers * local * 2


def test_fit_finds_context_parallelism_for_a_long_sequence():
    """A 1M-token sequence: no dp/pp/tp layout of 16 GPUs fits 12 GB (checkpointing, tp 8 and SP included),
    some cp > 1 layout does."""
    shape = ModelShape(layers=8, hidden=1024, heads=16, seq=1 << 20, vocab=50304)
    every = list(candidates(shape, 16, 8, 16, 1))
    assert min(p.peak_device_bytes for p in every if p.strategy.cp == 1) > 12e9
    ranked = fit(shape, 16, 12e9, HARDWARE["h100-ib"], global_batch=16)
    assert ranked and all(p.strategy.cp > 1 and p.peak_device_bytes <= 12e9 for p, _ in ranked)
    # where a cp = 1 layout fits, --fit lists only those (its estimate would rank cp on bytes alone)
    assert all(p.strategy.cp == 1 for p, _ in fit(shape, 16, 20e9, HARDWARE["h100-ib"], global_batch=16))


def test_fit_enumerates_ep_for_a_moe_shape():
    ranked = fit(MOE, 8, 1e12, HARDWARE["h100-ib"], global_batch=8)
    assert {p.strategy.ep for p, _ in ranked} == {1, 2, 4, 8}


def test_cli_prints_cp_and_ep(capsys):
    assert main(["--params", "7e9", "--seq", "131072", "--gpus", "64", "--cp", "8", "--ulysses", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "dp8-cp8u-zero1" in out and "cp 8 (Ulysses)" in out and "cp " in out.split("sent per step")[1]
    assert main(["--params", "1e9", "--experts", "8", "--top-k", "2", "--gpus", "16", "--ep", "8", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "dp16-ep8-zero1" in out and "ep 8 of 8 experts" in out and "ep " in out.split("sent per step")[1]


@pytest.mark.parametrize("argv, message", [
    (["--params", "7e9", "--gpus", "4", "--cp", "0"], "argument --cp: got 0, allowed: a whole number in [1, 1e6]"),
    (["--params", "7e9", "--gpus", "4", "--ep", "1.5"], "argument --ep: got 1.5, allowed: a whole number in [1, 1e6]"),
    (["--params", "7e9", "--gpus", "4", "--experts", "0"],
     "argument --experts: got 0, allowed: a whole number in [1, 100000]"),
    (["--params", "7e9", "--experts", "8", "--capacity-factor", "0"], "argument --capacity-factor: got 0, allowed"),
    (["--params", "7e9", "--experts", "8", "--top-k", "3"], "argument --top-k: invalid choice"),
    (["--params", "7e9", "--gpus", "4", "--ep", "2"], "ep 2 needs a MoE shape whose experts (0)"),
    (["--params", "7e9", "--gpus", "4", "--experts", "6", "--ep", "4"], "ep 4 needs a MoE shape whose experts (6)"),
    (["--params", "7e9", "--gpus", "8", "--experts", "8", "--tp", "2", "--vocab", "50304"],
     "a MoE shape with tp > 1 is not planned"),
    (["--params", "7e9", "--gpus", "12", "--cp", "8"], "tp 1 x pp 1 x cp 8 = 8 does not divide the world size 12"),
    (["--params", "7e9", "--gpus", "8", "--cp", "4", "--dp", "4"], "dp 4 x pp 1 x cp 4 x tp 1 = 16 is not the world"),
    (["--params", "7e9", "--gpus", "8", "--cp", "8", "--seq", "1000"], "sequence 1000 does not divide by 2 x cp 8"),
    (["--params", "7e9", "--gpus", "8", "--cp", "8", "--ulysses", "--heads", "4"], "Ulysses needs cp > 1 dividing"),
    (["--params", "7e9", "--gpus", "8", "--ulysses"], "Ulysses needs cp > 1"),
])
def test_bad_cp_and_ep_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and message in err and err.count("\n") == 1 and out == "", err
