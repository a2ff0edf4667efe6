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
    (["--params=-7e9", "--gpus", "4"], "must be positive"),
    (["--params", "-7", "--gpus", "4"], "must be positive"),
    (["--params", "7e9", "--gpus", "0"], "at least 1 GPU"),
    (["--params", "seven"], "not a parameter count"),
    (["--gpus", "4"], "--gpus needs --params"),
    (["--table", "nope"], "invalid choice"),
])
def test_plan_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
