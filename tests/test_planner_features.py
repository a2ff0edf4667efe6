"""The planner's 1-bit Adam bytes, sparse attention activations and MoE stage-0 gradients against real runs:
ONE 2-rank launch (minizero_course/experiments/planner_features.py)."""
import pytest

from minizero import launch
from minizero_course.experiments.planner_features import FREEZE_STEP, GPT, SPARSE, STEPS
from minizero.planner import ModelShape, PlanError, ParallelStrategy, plan

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

N = 2
CATEGORIES = ("parameters", "master_params", "gradients", "optimizer_state")


@pytest.fixture(scope="module")
def runs():
    return launch.run("minizero_course.experiments.planner_features:validate", nprocs=N, timeout=600)


def test_onebit_bytes_per_step_and_over_the_run_equal_the_planners(runs):
    for rank, r in enumerate(runs):
        measured, planned = r["onebit"]["measured"], r["onebit"]["planned"]
        phases = planned["onebit"]
        assert measured["sent"] == [phases["warmup_step"]] * FREEZE_STEP \
            + [phases["compressed_step"]] * (STEPS - FREEZE_STEP), f"rank {rank}"
        assert sum(measured["sent"]) == phases["run_bytes"] == pytest.approx(planned["sent"]["dp"] * STEPS)
        assert phases["run_reduction"] == pytest.approx(STEPS * phases["warmup_step"] / sum(measured["sent"]))
        for c in CATEGORIES:  # one gradient copy: no DDP buckets under 1-bit Adam
            assert measured["ledger"][c]["device"] == planned["memory"][c], f"rank {rank}: {c}"
        assert measured["errors"] == planned["memory"]["compression_errors"], f"rank {rank}"


def test_sparse_attention_activations_equal_the_planners_up_to_the_stated_extras(runs):
    """Against the same run with dense attention: the scores shrink to the kept blocks, the block-sparse backward
    keeps its output; the kept-block indices (3 int64 each) are the sparse side's extra, the bool causal mask (s²
    bytes) the dense side's, per layer."""
    measured, planned = runs[0]["sparse"]["measured"], runs[0]["sparse"]["planned"]
    nnz, s = measured["nnz"], GPT["block_size"]
    assert planned["fraction"] == nnz * SPARSE["block"] ** 2 / (GPT["n_head"] * s * s) < 1
    extras = GPT["n_layer"] * (3 * 8 * nnz - s * s)
    assert measured["activations"] - measured["dense_activations"] == planned["sparse"] - planned["dense"] + extras
    assert abs(measured["activations"] - planned["sparse"]) <= 0.10 * measured["activations"]


@pytest.mark.parametrize("ep", [1, N])
def test_moe_stage0_gradients_are_one_copy_after_backward(runs, ep):
    """ep 1: DDP's .grad are views of its buckets once backward's averaging ran; ep N: ExpertDDPStrategy, no
    wrapper, the .grad alone. Both: one copy, as the ledger measures it after backward."""
    for rank, r in enumerate(runs):
        got = r["moe"][f"ep{ep}"]
        for c in CATEGORIES:
            assert got["measured"][c]["device"] == got["planned"][c], f"rank {rank} ep {ep}: {c}"
        assert got["measured"]["gradients"]["device"] == got["measured"]["parameters"]["device"], (rank, ep)


def test_onebit_run_reduction_follows_freeze_step_and_run_length():
    shape = ModelShape(layers=24, hidden=2048, heads=16, seq=1024, vocab=50304)
    def run(freeze, steps):
        return plan(shape, ParallelStrategy(64, precision="fp32", optimizer="onebitadam", freeze_step=freeze,
                                    steps=steps)).stages[0].onebit
    phases = run(15, 100)
    assert 31 < phases["step_reduction"] < 32  # 32 bits -> 1 bit + the scales
    n, w = shape.num_params(), 64
    assert phases["compressed_step"] == 2 * (w - 1) / w * (-(-n // (8 * w)) * 8 * w / 8 + 4 * w)
    assert phases["run_reduction"] == pytest.approx(100 / (15 + 85 / phases["step_reduction"]))
    assert 5.6 < phases["run_reduction"] < 5.7  # the paper's "up to 5x": a 15% warm-up bounds it (1 / 0.15 = 6.7)
    assert run(0, 100)["run_reduction"] == pytest.approx(phases["step_reduction"])
    assert run(100, 100)["run_reduction"] == 1


@pytest.mark.parametrize("kw, shape_kw, message", [
    ({"zero": 1, "precision": "fp32"}, {}, "1-bit Adam (onebitadam) runs at ZeRO stage 0"),
    ({"precision": "bf16"}, {}, "precision bf16"),
    ({"precision": "fp32", "freeze_step": -1}, {}, "freeze_step must be a whole number >= 0"),
    ({"optimizer": "adam", "cp": 2, "world": 4}, {"attention_density": 0.5}, "sparse attention"),
    ({"optimizer": "adam"}, {"attention_density": 0.0}, "attention_density is the kept fraction"),
])
def test_bad_onebit_or_sparse_plans(kw, shape_kw, message):
    shape = ModelShape(2, 32, 2, 16, 64, **shape_kw)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(shape, ParallelStrategy(**{"world": 2, "optimizer": "onebitadam", **kw}))


def test_cli_prints_onebit_phases_and_the_sparse_layouts_fraction(capsys):
    from minizero.cli.plan import main
    assert main(["--params", "1e9", "--gpus", "16", "--zero", "0", "--precision", "fp32", "--optimizer", "onebitadam",
                 "--freeze-step", "15000", "--steps", "100000"]) == 0
    out = capsys.readouterr().out
    assert "1-bit Adam, dp GB per step: warm-up" in out and "(32.0x fewer)" in out and "(5.66x fewer)" in out
    section = '{"mode": "fixed", "block": 64, "attention": "unidirectional"}'
    assert main(["--params", "1e9", "--seq", "8192", "--gpus", "8", "--zero", "1", "--sparse-attention", section]) == 0
    out = capsys.readouterr().out
    assert main(["--params", "1e9", "--seq", "8192", "--gpus", "8", "--zero", "1"]) == 0
    dense = capsys.readouterr().out
    def acts(text):
        return float(text.split("activations ")[1].split(";")[0])
    assert "of the a·s² scores kept" in out and acts(out) < acts(dense) / 2


def test_fit_ranks_onebit_layouts_on_the_runs_bytes():
    """--fit's step estimate takes the run's mean bytes per step: a short warm-up sends fewer."""
    from minizero.planner import HARDWARE, fit
    shape = ModelShape(layers=4, hidden=512, heads=8, seq=256, vocab=1024)
    def comm(**run):
        ranked = fit(shape, 4, 40e9, HARDWARE["h100-ib"], 4, precision="fp32", optimizer="onebitadam", **run)
        assert ranked and all(p.strategy.zero == 0 for p, _ in ranked)
        return ranked[0][1]["comm"]
    assert comm(freeze_step=150, steps=1000) < comm(freeze_step=500, steps=1000) < comm()


@pytest.mark.parametrize("argv, message", [
    (["--sparse-attention", '{"mode": "fixd"}'], "argument --sparse-attention: mode must be one of"),
    (["--sparse-attention", '{"mode": '], "argument --sparse-attention: Expecting value"),
    (["--sparse-attention", '{"block": 16}', "--seq", "1048576"], "65536 blocks per side, allowed: at most 8192"),
    (["--optimizer", "onebitadam"], "1-bit Adam (onebitadam) runs at ZeRO stage 0"),
    (["--freeze-step", "-1"], "argument --freeze-step: got -1, allowed: a whole number in [0, 1e12]"),
    (["--steps", "0"], "argument --steps: got 0, allowed: a whole number in [1, 1e12]"),
])
def test_bad_onebit_or_sparse_flags(argv, message, capsys):
    from minizero.cli.plan import main
    with pytest.raises(SystemExit) as exc:
        main(["--params", "1e9", "--gpus", "8", "--zero", "1", *argv])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and message in err and err.count("\n") == 1 and out == "", err
