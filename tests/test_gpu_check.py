"""`make test-gpu`'s script (tests/gpu/check.py) in its --quick CPU mode, so it cannot rot between GPU runs:
every part runs and every row of the table passes, while the self-test's two parts, a ring all-reduce one
element off and a hung part, come out as failed rows and the parts after them still run."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu", "check.py")

# what each part must report (substrings of its rows' checks)
EXPECTED = {
    "ring": ["ring all-reduce = backend all-reduce", "ring all-reduce: bytes sent per rank"],
    "strategies": [f"{s}: {what}" for s in ("ddp", "zero1", "zero2", "zero3")
                   for what in ("losses = one process", "model states = estimator")] + ["memory per rank ordered"],
    "loss_scaling": ["fp16 + LossScaler tracks fp32", "skips it on every rank"],
    "offload": ["losses = ZeRO-2 without offload", "offload (ZeRO-2 + cpu): model states = planner",
                "bytes device->host and host->device"],
    "zeropp": ["ZeRO++ (qwZ + hpZ): losses = ZeRO-3", "ZeRO++ (qwZ + hpZ): model states = planner"],
    "pipeline": ["1F1B (pp=4, m=8): losses = one process", "1F1B (pp=4): model states = planner"],
    "tensor": ["TP (t=4): losses = one process", "TP (t=4): model states = planner"],
    "context": ["ring attention (cp=4): losses = one process", "model states = planner"],
    "experts": ["MoE dispatch", "MoE (ep=2, ZeRO-1): model states = planner"],
    "world_of_one": ["torch.distributed backend", "DDP, ZeRO-3 losses = one process"],
    "tensor_cores": ["float16 matmul", "bfloat16 matmul"],
    "offload_one": ["losses = without offload", "device / host bytes = estimator", "bytes each way per step"],
    "quantizer": ["error bound", "codes = the CPU's"],
}


def _run(*args, timeout=420):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    docs = os.path.join(ROOT, "docs", "gpu.md")
    before = open(docs).read() if os.path.exists(docs) else None
    proc = _run("--quick", "--selftest", "--out", str(out / "gpu.md"), "--json", str(out / "gpu.json"))
    after = open(docs).read() if os.path.exists(docs) else None
    with open(out / "gpu.json") as f:
        return proc, json.load(f), (out / "gpu.md").read_text(), before == after


def test_every_part_reports_its_rows_and_they_pass(quick):
    proc, result, _, _ = quick
    parts = result["parts"]
    for name, wanted in EXPECTED.items():
        checks = [r["check"] for r in parts[name]["rows"]]
        for want in wanted:
            assert any(want in c for c in checks), f"{name}: no row '{want}' in {checks}\n{proc.stdout[-3000:]}"
        failed = [r for r in parts[name]["rows"] if not r["pass"]]
        assert not failed, f"{name}: {failed}"
    assert set(parts) == set(EXPECTED) | {"selftest_hang", "selftest_wrong"}


def test_a_wrong_result_and_a_hung_part_are_failed_rows_and_the_rest_still_runs(quick):
    proc, result, _, _ = quick
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    hang = result["parts"]["selftest_hang"]["rows"]
    assert len(hang) == 1 and not hang[0]["pass"]
    assert "timed out after 10 s" in hang[0]["measured"] and "barrier" in hang[0]["measured"], hang
    wrong = result["parts"]["selftest_wrong"]["rows"]
    assert [r["pass"] for r in wrong] == [False] and "self-test" in wrong[0]["check"], wrong
    assert "1.0e-03" in wrong[0]["measured"]  # the one element off by 1e-3, measured as such
    # the parts after the hang ran in a fresh launch: the ring's own row passes there
    assert all(r["pass"] for r in result["parts"]["ring"]["rows"])


def test_the_table_and_the_report_go_where_asked_and_leave_docs_alone(quick):
    proc, result, md, docs_untouched = quick
    assert docs_untouched, "a --quick run with --out must not rewrite docs/gpu.md"
    assert "| check | expected | measured | pass |" in md
    assert f"torch {result['info']['torch']}" in md and result["info"]["date"] in md
    assert sum(r["pass"] for r in result["rows"]) == len(result["rows"]) - 2
    assert f"{len(result['rows']) - 2}/{len(result['rows'])} rows pass" in proc.stdout
    for r in result["rows"]:  # the printed table holds every row
        assert r["check"][:60] in proc.stdout


@pytest.mark.parametrize("args, says", [(["--only", "ring,nope"], "--only: unknown part(s) nope"),
                                        (["--nprocs", "3"], "--nprocs must be an even number")])
def test_bad_arguments_say_which_and_write_nothing(tmp_path, args, says):
    proc = _run(*args, "--out", str(tmp_path / "gpu.md"), timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "gpu.md").exists()
