"""The planner (minizero/planner/) and `python -m minizero plan`: shapes, formulas it shares with
the code, --fit, --json and every bad input with its message. In-process: no ranks (the comparison
with real runs is tests/test_planner_validation.py)."""
import json

import pytest

from minizero.cli.plan import main
from minizero.models import GPTConfig, TinyGPT
from minizero.planner import HARDWARE, ModelShape, PlanError, ParallelStrategy, fit, plan
from minizero.planner.fit import candidates

SHAPE = ModelShape(layers=24, hidden=2048, heads=16, seq=1024, vocab=50304)
SHAPE_ARGS = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "50304"]


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_tinygpts(tied):
    for layers, hidden, heads, seq, vocab in ((2, 32, 2, 16, 64), (3, 24, 4, 8, 48)):
        model = TinyGPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden,
                                  tie_weights=tied))
        shape = ModelShape(layers, hidden, heads, seq, vocab, tied)
        assert shape.num_params() == model.num_params()
        assert plan(shape, ParallelStrategy(1)).stages[0].params == model.num_params()


def test_pipeline_stages_hold_the_model_once_and_tp_splits_the_matrices():
    stages = plan(SHAPE, ParallelStrategy(8, pp=4, micro_batches=8)).stages
    assert sum(s.params for s in stages) == SHAPE.num_params()
    assert stages[0].params > stages[1].params  # the embeddings
    two = plan(SHAPE, ParallelStrategy(8, tp=2)).stages[0]
    assert SHAPE.num_params() / 2 < two.params < SHAPE.num_params() / 2 + 6 * 2048 * 24 + 1024 * 2048 + 2 * 2048


def test_memory_orders_and_activation_levers():
    totals = [sum(plan(SHAPE, ParallelStrategy(8, zero=z)).stages[0].memory[c] for c in
                  ("parameters", "master_params", "gradients", "optimizer_state")) for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    act = lambda **kw: plan(SHAPE, ParallelStrategy(8, micro_batch=4, **kw)).stages[0].memory["activations"]  # noqa: E731
    assert act(checkpointing=True) < act() / 10
    assert act(tp=2, sp=True) < act(tp=2) < act()
    gpipe = plan(SHAPE, ParallelStrategy(8, pp=4, micro_batches=8, schedule="gpipe")).stages[0].memory["activations"]
    f1b1 = plan(SHAPE, ParallelStrategy(8, pp=4, micro_batches=8)).stages[0].memory["activations"]
    assert gpipe == pytest.approx(2 * f1b1)  # 8 micro-batches in flight vs min(p - 0, m) = 4


def test_link_classes_follow_the_mesh():
    st = plan(SHAPE, ParallelStrategy(16, node_size=8, tp=8, pp=2, micro_batches=4)).stages[0]
    assert st.link == {"tp": "intra-node", "pp": "cross-node"}  # tp fills a node; the stages sit on two
    st = plan(SHAPE, ParallelStrategy(16, node_size=8, tp=2, pp=2, micro_batches=4)).stages[0]
    assert st.link == {"dp": "cross-node", "tp": "intra-node", "pp": "intra-node"}
    assert sum(st.sent_by_link.values()) == pytest.approx(sum(st.sent.values()))


def test_cli_prints_stages_and_links(capsys):
    assert main(SHAPE_ARGS + ["--gpus", "16", "--tp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    assert "dp4-pp2-tp2-zero1" in out and "stage 1:" in out and "cross-node" in out and "estimated step" in out


def test_cli_zeropp_moves_bytes_off_the_cross_node_links(capsys):
    """--qwz --hpz --qgz: ZeRO-3's ring traffic becomes a quantized ring (forward), a gather inside the node
    (hpZ) and a two-hop gradient all-to-all; fewer bytes cross nodes, and hpZ's partition costs memory."""
    base = ["--gpus", "16", "--zero", "3", "--micro-batch", "2", "--json"]
    main(SHAPE_ARGS + base)
    z3 = json.loads(capsys.readouterr().out)["stages"][0]
    main(SHAPE_ARGS + base + ["--qwz", "--hpz", "--qgz"])
    zpp = json.loads(capsys.readouterr().out)["stages"][0]
    assert set(zpp["sent"]) == {"dp", "dp-node", "dp-across"} and set(z3["sent"]) == {"dp"}
    assert zpp["link"]["dp-node"] == "intra-node" and zpp["link"]["dp-across"] == "cross-node"
    # qwZ: the forward all-gather in int8 (+ scales) instead of bf16, about half of one of ZeRO-3's three
    assert zpp["sent"]["dp"] == pytest.approx(z3["sent"]["dp"] / 6, rel=0.01)
    assert zpp["memory"]["parameters"] - z3["memory"]["parameters"] == pytest.approx(SHAPE.num_params() * 2 / 8,
                                                                                     rel=0.01)


def test_cli_json_is_the_plan(capsys):
    main(SHAPE_ARGS + ["--gpus", "8", "--zero", "2", "--checkpointing", "--json"])
    got = json.loads(capsys.readouterr().out)
    want = plan(SHAPE, ParallelStrategy(8, zero=2, checkpointing=True))
    assert got["stages"][0]["memory"] == want.stages[0].memory and got["name"] == "dp8-zero2-ckpt"
    assert got["step_time"]["total"] > 0


def test_fit_lists_only_layouts_that_fit_fastest_first(capsys):
    ranked = fit(SHAPE, 16, 20e9, HARDWARE["h100-ib"], global_batch=64, micro_batch=2)
    assert ranked and all(p.peak_device_bytes <= 20e9 for p, _ in ranked)
    times = [t["total"] for _, t in ranked]
    assert times == sorted(times)
    assert main(SHAPE_ARGS + ["--gpus", "16", "--fit", "20", "--global-batch", "64", "--micro-batch", "2",
                              "--top", "3"]) == 0
    assert ranked[0][0].strategy.name() in capsys.readouterr().out


def test_impossible_fit_says_the_smallest_footprint(capsys):
    smallest = min(p.peak_device_bytes for p in candidates(SHAPE, 16, 8, 16, 1))  # every layout, cp > 1 included
    with pytest.raises(SystemExit):
        main(SHAPE_ARGS + ["--gpus", "16", "--fit", "0.05"])
    err = capsys.readouterr().err
    assert "nothing fits in 0.05 GB per GPU: the smallest footprint is" in err
    assert f"{smallest / 1e9:.3g} GB" in err


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "16", "--tp", "2", "--dp", "4"], "dp 4 x pp 1 x tp 2 = 8 is not the world size 16"),
    (["--gpus", "12", "--tp", "8"], "does not divide the world size 12"),
    (["--gpus", "32", "--tp", "16"], "tp 16 does not fit in a node of 8 ranks"),
    (["--gpus", "16", "--pp", "2", "--zero", "2"], "ZeRO stage 2 with pipeline parallelism"),
    (["--gpus", "16", "--pp", "2", "--zero", "3"], "ZeRO stage 3 with pipeline parallelism"),
    (["--gpus", "16", "--tp", "8", "--heads", "4"], "4 attention heads do not divide by tp 8"),
    (["--gpus", "4", "--zero", "0", "--offload"], "offload needs ZeRO stage 1, 2 or 3"),
    (["--gpus", "4", "--sp"], "sequence parallelism needs tp > 1"),
    (["--gpus", "4", "--pp", "4", "--layers", "2"], "4 pipeline stages but only 2 layers"),
    (["--gpus", "16", "--zero", "1", "--qwz"], "ZeRO++ (qwz, hpz, qgz) is ZeRO stage 3 over every rank"),
    (["--gpus", "12", "--zero", "3", "--hpz"], "node_size 8 must divide the world 12"),
])
def test_bad_layouts_are_clear_errors(argv, message, capsys):
    args = list(SHAPE_ARGS)
    for flag in ("--heads", "--layers"):  # the case's own value wins
        if flag in argv:
            i = args.index(flag)
            del args[i:i + 2]
    with pytest.raises(SystemExit):
        main(args + argv)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_strategy_errors_are_plan_errors():
    with pytest.raises(PlanError, match="tp 16 does not fit"):
        plan(SHAPE, ParallelStrategy(16, node_size=8, tp=16))
