"""`python -m minizero_course bench scale --quick`: the largest-model search on 2 ranks under a small memory cap
(0.2 GB above the first probe's job: torch DDP grows ~0.3 GB from s 4 to 6, ZeRO-3 ~0.1), torch DDP against minizero
ZeRO-3 + zero.Init, checked against
independent counts: the watcher's kill, the ledger against memory.estimate, sharding's 1/N."""
import json
import os
import subprocess
import sys

import pytest

from minizero_course.bench.scale import grow, plot, search
from minizero_course.bench.scale_probe import CANDIDATES, count, gpt

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`


def test_size_rule_and_search_without_jobs():
    # Ψ ≈ 49152 s³ (12·s·(64 s)² in the blocks) plus embeddings and norms
    assert gpt(4) == {"vocab_size": 64, "block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 256}
    assert 49152 * 34 ** 3 < count(34) < 1.01 * 49152 * 34 ** 3 and count(34) > 1.9e9
    assert grow(3) == 5 and grow(34) == 54  # about 4x the parameters per step
    def fits(c, s):
        return {"candidate": c, "size": s, "psi": count(s), "ranks": 4,
                "outcome": "ok" if s <= 11 else "memory cap"}
    res = search("x", 3, 54, fits, resolution=1.2, log=lambda s: None)
    assert res["largest"]["size"] == 11 and res["probes"][-1]["size"] in (11, 12)
    assert [r["size"] for r in res["probes"]][:4] == [3, 5, 8, 13] and res["stopped_by"] == "memory cap"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    tmp = d / "tmp"  # the probes' folders go here: none may be left
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "bench", "scale", "--quick",
                           "--json", str(d / "s.json")],
                          check=False, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in tmp.iterdir() if p.name.startswith("minizero-")] == [], "probes left folders"
    return proc.stdout, json.loads((d / "s.json").read_text())


def test_quick_search_finds_a_larger_model_for_zero3_than_ddp(quick):
    out, res = quick
    ddp, zero3 = res["candidates"]["torch-ddp"], res["candidates"]["minizero-zero3-init"]
    assert ddp["largest"]["size"] == 4 and ddp["stopped_by"].startswith("memory cap")
    assert zero3["largest"]["psi"] > ddp["largest"]["psi"]
    capped = ddp["probes"][-1]
    # killed by the watcher: the job's sampled peak passed the cap, and nothing came back from its ranks
    assert capped["job_peak_unshared"] > res["cap_bytes"] and "per_rank" not in capped
    assert "torch-ddp" in out and "minizero-zero3-init" in out
    for r in (p for c in res["candidates"].values() for p in c["probes"] if p["outcome"] == "ok"):
        assert r["losses"][-1] < r["losses"][0] and len(r["rss_peak"]) == 2
        assert r["step_s"] >= r["comm_s"] > 0


def test_quick_report_and_plot_show_only_what_was_measured(quick, tmp_path):
    """--quick calibrates nothing and sweeps no ranks: its report says so instead of printing nan, its plot has
    no empty panel, and both give the same memory cap."""
    out, res = quick
    assert "nan" not in out and "bound and MFU: not computed" in out
    drawn = plot(res, str(tmp_path / "s.png"))
    assert len(drawn["panels"]) == 2 and all(len(p["series"]) == 2 for p in drawn["panels"]), drawn
    cap = f"memory cap {res['cap_bytes'] / 1e9:.1f} GB"
    assert cap in out and cap in drawn["title"], (out.splitlines()[0], drawn["title"])


def test_every_candidate_has_its_own_style_in_the_plot(tmp_path):
    """All of bench scale's candidates on one plot: no two series share colour, marker and line style."""
    def probe(s):
        return {"size": s, "psi": count(s), "ranks": 4, "outcome": "ok", "step_s": 1.0 + s, "rss_peak": [2 ** 30]}
    results = {"ranks": 4, "cap_bytes": 12e9, "sweep_psi": count(4),
               "candidates": {name: {"probes": [probe(3), probe(5)]} for name in CANDIDATES},
               "ranks_sweep": {name: [{**probe(4), "ranks": n} for n in (1, 2, 4)] for name in CANDIDATES}}
    drawn = plot(results, str(tmp_path / "s.png"))
    assert len(drawn["panels"]) == 4
    for panel in drawn["panels"]:
        styles = [(str(c), m, ls) for _, c, m, ls in panel["series"]]
        assert len(panel["series"]) == len(CANDIDATES) and len(set(styles)) == len(styles), styles


def test_quick_bytes_per_parameter_against_the_estimator(quick):
    """The ledger walks the tensors each rank holds; memory.estimate is the formula (fp32 Adam: 16 B per
    parameter, replicated by DDP, over N = 2 ranks by ZeRO-3). torch DDP holds 4 B more: its reducer's
    bucket copy of the gradients (gradient_as_bucket_view=False, torch's default), which the estimator
    leaves out as a transient buffer."""
    _, res = quick
    last = {name: [p for p in c["probes"] if p["outcome"] == "ok"][-1] for name, c in res["candidates"].items()}
    ddp, zero3 = last["torch-ddp"], last["minizero-zero3-init"]
    assert ddp["estimate"] == 16 * ddp["psi"] and zero3["estimate"] == 16 * zero3["psi"] / 2
    assert max(ddp["ledger"]) / ddp["psi"] == pytest.approx(16 + 4, rel=0.03)
    assert max(zero3["ledger"]) == pytest.approx(zero3["estimate"], rel=0.05)
