"""The data-parallel strategy protocol (minizero/runtime/strategies.py: Strategy, an ABC) is the whole contract:
every strategy implements it, and the runtime (engines, checkpoints, chain) reads no strategy name it does
not declare. Static: reads the runtime's source with ast, launches nothing."""
import ast
import glob
import inspect

import pytest
import torch

import minizero.runtime.chain as chain
import minizero.runtime.expert_strategy  # noqa: F401  (its classes join Strategy's subclasses)
from minizero.runtime.strategies import Strategy


def subclasses(cls) -> list:
    return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]


def built_by_select_strategy() -> set:
    """Names of the classes select_strategy (runtime/chain.py) can build: every Name it mentions."""
    tree = ast.parse(inspect.getsource(chain.select_strategy))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id.endswith("Strategy")}


# every strategy class the runtime has, found, not listed: a new one is checked the day it is written
CONCRETE = sorted({c for c in subclasses(Strategy) if c.__module__.startswith("minizero.runtime")
                   and c.__name__ in built_by_select_strategy()}, key=lambda c: c.__name__)


def test_the_list_holds_every_strategy_select_strategy_builds():
    names = {c.__name__ for c in CONCRETE}
    assert built_by_select_strategy() - {"Strategy"} == names, built_by_select_strategy() - names
    assert {"OneBitAdamStrategy", "HybridShardStrategy", "ExpertZero1Strategy", "Zero3Strategy"} <= names


def declared() -> set:
    """Methods and class attributes of Strategy, and the attributes its __init__ sets."""
    names = {n for n in vars(Strategy) if not n.startswith("__")}
    init = ast.parse(inspect.getsource(Strategy.__init__).strip())
    names |= {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Attribute)}
    return names


def used_by_runtime() -> dict:
    """{name: 'file:line'} of every `X.strategy.NAME`, `strategy.NAME` and getattr(strategy, "NAME") outside
    the strategy classes themselves."""
    used = {}
    for path in sorted(glob.glob("minizero/runtime/*.py")):
        if path.endswith(("strategies.py", "expert_strategy.py")):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                base = node.value
                if (isinstance(base, ast.Name) and base.id == "strategy") or \
                        (isinstance(base, ast.Attribute) and base.attr == "strategy"):
                    used.setdefault(node.attr, f"{path}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and \
                    len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                target = node.args[0]
                if getattr(target, "id", None) == "strategy" or getattr(target, "attr", None) == "strategy":
                    used.setdefault(node.args[1].value, f"{path}:{node.lineno}")
    return used


def test_the_runtime_reads_only_what_the_protocol_declares():
    used, names = used_by_runtime(), declared()
    assert len(used) >= 15, sorted(used)  # the scan sees the engines' calls (reduced_grads, apply, segments, ...)
    undeclared = {n: where for n, where in used.items() if n not in names}
    assert not undeclared, f"the runtime uses strategy names the Strategy protocol does not declare: {undeclared}"


def test_the_scan_catches_an_undeclared_name(tmp_path, monkeypatch):
    (tmp_path / "minizero" / "runtime").mkdir(parents=True)
    (tmp_path / "minizero" / "runtime" / "x.py").write_text(
        "def f(e):\n    return e.strategy.ddp, getattr(e.strategy, 'bucket')\n")
    monkeypatch.chdir(tmp_path)
    assert set(used_by_runtime()) == {"ddp", "bucket"}


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_every_strategy_implements_the_protocol(cls):
    assert issubclass(cls, Strategy)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"


def test_a_strategy_missing_a_step_method_cannot_be_built():
    class Half(Strategy):
        def reduced_grads(self): ...
    with pytest.raises(TypeError, match="abstract"):
        Half(torch.nn.Linear(1, 1), None, None)
    assert {"apply", "zero_grad", "segments", "grad_names"} <= set(Half.__abstractmethods__)
