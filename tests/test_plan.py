"""`minizero plan`: the figures it prints, and clean errors on bad input."""
import pytest

from minizero.cli.plan import main


def _rows(text):
    """{first word: [numbers on that line]} for the table lines."""
    rows = {}
    for line in text.splitlines():
        words = line.replace("[", " ").replace("]", " ").split()
        try:
            rows[words[0]] = [float(w) for w in words[1:] if w != "GB"]
        except (ValueError, IndexError):
            pass
    return rows


def test_plan_7b_on_4_gpus(capsys):
    assert main(["--params", "7e9", "--gpus", "4"]) == 0
    rows = _rows(capsys.readouterr().out)
    #                  params grads optimizer total (GB per GPU)
    assert rows["DDP"] == [14, 14, 84, 112]
    assert rows["ZeRO-1"] == [14, 14, 21, 49]
    assert rows["ZeRO-2"] == [14, 3.5, 21, 38.5]
    assert rows["ZeRO-3"] == [3.5, 3.5, 21, 28]
    assert [rows[d] for d in ("fp32", "fp16", "int8", "int4")] == [[28], [14], [7], [3.5]]


def test_plan_accepts_suffixes_and_k(capsys):
    main(["--params", "7B", "--gpus", "4"])
    assert _rows(capsys.readouterr().out)["ZeRO-3"] == [3.5, 3.5, 21, 28]
    main(["--params", "1e9", "--k", "8"])  # one GPU by default
    assert _rows(capsys.readouterr().out)["DDP"] == [2, 2, 8, 12]


def test_plan_zero_paper_table(capsys):
    assert main(["--table", "zero-paper"]) == 0
    rows = _rows(capsys.readouterr().out)
    # computed value, then the paper's printed one, for each of the three stages
    assert rows["4"] == [52.5, 52.5, 41.25, 41.3, 30, 30]
    assert rows["1024"] == [30.09, 30.1, 15.10, 15.1, 0.12, 0.12]
    assert rows["1"] == [120] * 6


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to plan"),
    (["--params=-7e9", "--gpus", "4"], "argument --params: got -7e9, allowed: a number in [1, 1e15]"),
    (["--params", "1e30"], "argument --params: got 1e30, allowed: a number in [1, 1e15]"),
    (["--params", "7e9", "--gpus", "0"], "argument --gpus: got 0, allowed: a whole number in [1, 1e6]"),
    (["--params", "7e9", "--gpus", "1e12"], "argument --gpus: got 1e12, allowed: a whole number in [1, 1e6]"),
    (["--params", "7e9", "--gpus", "2.5"], "argument --gpus: got 2.5, allowed: a whole number in [1, 1e6]"),
    (["--params", "seven"], "argument --params: 'seven' is not a number"),
    (["--params", "7e9", "--k", "-1"], "argument --k: got -1, allowed: a number in [0, 64]"),
    (["--gpus", "4"], "--gpus needs --params"),
    (["--table", "nope"], "invalid choice"),
    (["--params", "7e9", "--fit", "80", "--mfu", "-1"], "argument --mfu: got -1, allowed: a number in (0, 1]"),
    (["--params", "7e9", "--zero", "1", "--mfu", "0"], "argument --mfu: got 0, allowed: a number in (0, 1]"),
    (["--params", "7e9", "--zero", "1", "--flops", "nan"], "argument --flops: got nan, allowed: a number in (0, 1e18]"),
    (["--params", "7e9", "--zero", "1", "--inter-bw", "inf"],
     "argument --inter-bw: got inf, allowed: a number in (0, 1e14]"),
    (["--params", "7e9", "--fit", "0"], "argument --fit: got 0, allowed: a number in (0, 100000]"),
    (["--params", "7e9", "--zero", "1", "--micro-batch", "0"],
     "argument --micro-batch: got 0, allowed: a whole number"),
    (["--params", "7e9", "--zero", "1", "--node-size", "1e5"],
     "argument --node-size: got 1e5, allowed: a whole number in [1, 4096]"),
    (["--layers", "2", "--hidden", "65", "--heads", "4", "--seq", "16", "--vocab", "64"],
     "--hidden 65 does not divide by --heads 4"),
    (["--params", "1e9", "--zero", "1", "--heads", "5"], "--hidden 2048 does not divide by --heads 5"),
    (["--layers", "100000", "--hidden", "1000000", "--heads", "8", "--seq", "8", "--vocab", "8"],
     "this shape has 1.2e18 parameters, allowed: at most 1e15"),
    (["--params", "7e9", "--gpus", "2048", "--fit", "80"],
     "argument --gpus: got 2048 with --fit, allowed: a whole number in [1, 1024]"),
])
def test_plan_bad_input(argv, message, capsys):
    """One line on stderr naming the flag, the value and the range; exit 2; nothing on stdout."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert message in err and err.count("\n") == 1 and err.startswith("minizero plan: error: ") and out == ""


def test_plan_table_columns_stay_apart_at_the_largest_sizes(capsys):
    """1e15 parameters, K = 64 (the upper bounds): every figure is its own word, and the values are right."""
    main(["--params", "1e15", "--k", "64"])
    rows = _rows(capsys.readouterr().out)
    assert rows["DDP"] == [2e6, 2e6, 64e6, 68e6] and rows["fp32"] == [4e6]


def test_plan_accepts_the_bounds(capsys):
    assert main(["--params", "7e9", "--zero", "1", "--mfu", "1", "--gpus", "8", "--json"]) == 0
    assert '"world": 8' in capsys.readouterr().out
    main(["--params", "1k", "--gpus", "1e6"])  # the smallest and largest counts, written as people write them
    assert _rows(capsys.readouterr().out)["ZeRO-3"] == [0, 0, 0, 0]
