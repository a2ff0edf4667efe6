"""The model-state numbers lessons 00 and 07 print, and the planner's (lesson 11 prints the planner's), come
from ONE function: memory.estimate_by_location (memory.estimate is a sum over it). The lessons' own cells run
here with that function wrapped by a spy, and the values they keep are compared with what it returned.
(Lesson 11's cells are not run here: they print the planner, whose use of the function is checked below.)"""
import json
import os
from pathlib import Path

import matplotlib
import pytest

from minizero import memory

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent


def _cells(name, *markers):
    """The code cells of lessons/NAME that contain each marker, in notebook order."""
    cells = json.loads((ROOT / "lessons" / name).read_text())["cells"]
    sources = ["".join(line for line in "".join(c["source"]).splitlines(keepends=True)
                       if not line.lstrip().startswith("%"))  # IPython magics
               for c in cells if c["cell_type"] == "code"]
    picked = [next(s for s in sources if m in s) for m in markers]
    return sorted(set(picked), key=sources.index)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = memory.estimate_by_location

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        return out
    monkeypatch.setattr(memory, "estimate_by_location", recorded)
    return calls


def _run(name, *markers):
    namespace = {"memory": memory}  # what the lessons import first
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        for source in _cells(name, *markers):
            exec(compile(source, name, "exec"), namespace)  # noqa: S102  the lesson's own cell
    finally:
        os.chdir(cwd)
    return namespace


def _device(by_location):
    return sum(v["device"] for v in by_location.values())


def test_lesson00_offload_floors_come_from_the_estimator(spy):
    ns = _run("00_memory.ipynb", "PSI_7B =", "SEED001 =", "floor2 =")
    assert spy, "lesson 00 computed its floors without memory.estimate_by_location"
    want2 = memory.estimate_by_location(7e9, 4, 2, offload_optimizer="cpu")
    want1 = memory.estimate_by_location(7e9, 4, 1, offload_optimizer="cpu")
    assert want2 in spy and want1 in spy
    assert ns["floor2"] * ns["GB"] == _device(want2) == 2 * 7e9  # ZeRO-2 + offload: the 16-bit weights alone
    assert ns["floor1"] * ns["GB"] == _device(want1) == 4 * 7e9  # ZeRO-1: weights + full gradients


def test_lesson07_eightfold_and_tenfold_come_from_the_estimator(spy):
    ns = _run("07_offload.ipynb", "def device_bytes", "def fits")  # (its first cell launches the job)
    assert spy, "lesson 07 computed its ratios without memory.estimate_by_location"
    assert ns["offload"] == _device(memory.estimate_by_location(1.0, 1, 2, offload_optimizer="cpu")) == 2
    assert ns["plain"] / ns["offload"] == 8
    # the 10x table: the model states it adds up for the largest offloaded model are the function's
    layers = ns["largest"](4, True)
    states = memory.estimate_by_location(layers * ns["LAYER"], 1, 2, offload_optimizer="cpu")
    assert states in spy and layers > 8 * ns["largest"](4, False) > 0


def test_the_planner_uses_the_same_estimator(spy):
    """Lesson 11 prints the planner's model states: plan() takes them from the same function, per stage."""
    from minizero.planner.plan import STATE_BYTES, ModelShape, ParallelStrategy, plan
    shape = ModelShape.from_params(1.3e9)
    p = plan(shape, ParallelStrategy(world=4, zero=2, offload=True, precision="fp16"))
    assert len(spy) == len(p.stages)
    for stage, states in zip(p.stages, spy):
        assert states == memory.estimate_by_location(stage.params, 4, 2, param_bytes=2, grad_bytes=2,
                                                     state_bytes=STATE_BYTES["adam"], offload_optimizer="cpu")
        assert {c: stage.memory[c] for c in states} == {c: v["device"] for c, v in states.items()}
        assert stage.memory["gradients"] == 0 and stage.memory["parameters"] == 2 * stage.params
