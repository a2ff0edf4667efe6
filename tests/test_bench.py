"""`python -m minizero_course bench` end to end on a tiny run (2 ranks, 3 timed steps, 3 candidates),
and what it measured checked against independent counts."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from minizero_course.bench.bench import paired_ratio

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

CANDIDATES = ["minizero-ddp", "minizero-zero3", "torch-ddp"]


def test_paired_ratio_is_the_median_of_per_step_ratios():
    med, (lo, hi) = paired_ratio([2.0, 4.0, 6.0, 100.0], [1.0, 2.0, 3.0, 10.0])
    assert med == 2.0 and lo <= med <= hi
    assert paired_ratio([1.0, 1.0], [1.0, 1.0]) == (1.0, (1.0, 1.0))


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    tmp = d / "tmp"  # the ranks' own temporary folders go here: the run must leave none behind
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "bench", "--nprocs", "2", "--steps", "3",
                           "--warmup", "1", "--candidates", *CANDIDATES, "--json", str(d / "b.json"),
                           "--plot", str(d / "b.png")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in tmp.iterdir() if p.name.startswith("minizero-bench")] == [], "bench left its folders"
    return proc.stdout, json.loads((d / "b.json").read_text()), d / "b.png", proc.stderr


def test_table_json_and_plot(bench):
    out, s, png, _ = bench
    for name in CANDIDATES:
        assert f"\n{name:<31}|" in out
    assert "target: minizero DDP within 5% of torch DDP: paired step-time ratio" in out
    assert png.exists() and png.stat().st_size > 10_000
    assert s["N"] == 2 and set(s["candidates"]) == set(CANDIDATES)
    for r in s["candidates"].values():
        assert len(r["step_s"]) == 3 and all(t > 0 for t in r["step_s"])
        assert r["q1_s"] <= r["median_step_s"] <= r["q3_s"]
        # RSS in bytes: each rank's high-water mark holds at least the tensors its ledger counts
        # (a unit slip, kB for bytes, puts a peak of hundreds of MB below a ledger of one MB)
        assert all(peak >= held for peak, held in zip(r["rss_peak"], r["ledger_bytes"])), (
            r["rss_peak"], r["ledger_bytes"])
    ref = s["candidates"]["torch-ddp"]
    assert ref["ratio"] == 1.0 and ref["paired_ratio"] == 1.0 and ref["paired_ci95"] == [1.0, 1.0]
    # the target's ratio is the median of the per-step ratios against torch DDP, recomputed here
    target, ours = s["targets"][0], s["candidates"]["minizero-ddp"]
    per_step = [a / b for a, b in zip(ours["step_s"], ref["step_s"])]
    assert target["what"].startswith("minizero DDP")
    assert target["ratio"] == pytest.approx(statistics.median(per_step)) == ours["paired_ratio"]
    assert target["ci95"][0] <= target["ratio"] <= target["ci95"][1]
    assert target["verdict"].startswith("met") == (target["ratio"] <= target["limit"]), target


def test_progress_goes_to_stderr_and_the_report_to_stdout(bench):
    """The ranks say each candidate and each few rounds as they go, on stderr: the report on stdout, which the
    site keeps, has none of it."""
    out, _, _, err = bench
    for i, name in enumerate(CANDIDATES, 1):
        assert f"bench: memory and bytes {i}/3: {name}" in err, err[-2000:]
    assert "bench: time, interleaved: round 1/4" in err and "round 4/4" in err, err[-2000:]
    assert "memory and bytes" not in out and "interleaved: round" not in out


def test_bytes_sent_counted_where_sent_equal_the_ring_formula(bench):
    _, s, _, _ = bench
    n, psi = s["N"], s["psi"]
    ring = 2 * (n - 1) / n * psi * 4  # fp32 gradients, all-reduced once
    c = s["candidates"]
    # minizero: comm.stats; torch DDP: its default hook's dist.all_reduce calls, counted in bench.py
    assert c["minizero-ddp"]["bytes_source"] == "minizero.comm"
    assert c["minizero-ddp"]["sent_per_step"] == [ring] * n
    assert c["torch-ddp"]["bytes_source"].startswith("torch.distributed calls")
    assert c["torch-ddp"]["sent_per_step"] == [ring] * n
    # ZeRO-3: all-gather in forward and again in backward + reduce-scatter = 1.5x, a little less
    # because a unit whose weights backward never reads is not gathered twice, a little more for padding
    for sent in c["minizero-zero3"]["sent_per_step"]:
        assert 1.4 < sent / ring < 1.51


def test_ledger_and_losses(bench):
    _, s, _, _ = bench
    psi, c = s["psi"], s["candidates"]
    for ledger in c["minizero-ddp"]["ledger"]:  # gradients live in the buckets (p.grad is a view)
        assert ledger["by_category"]["parameters"] == 4 * psi and ledger["by_category"]["gradients"] == 4 * psi
    for ledger in c["torch-ddp"]["ledger"]:  # p.grad AND the reducer's buckets (gradient_as_bucket_view=False)
        assert ledger["by_category"]["gradients"] == 8 * psi
    # ZeRO-3 shards all of DDP's fp32 model states (4 + 4 + 8 bytes/param): 1/N of them, up to padding
    ddp = c["minizero-ddp"]["ledger_bytes"][0]
    for z3 in c["minizero-zero3"]["ledger_bytes"]:
        assert abs(z3 / (ddp / s["N"]) - 1) < 0.01
    # same init and data: the first loss agrees bitwise-close, later ones to fp32 reduction order
    first = [r["losses"][0] for r in c.values()]
    last = [r["losses"][-1] for r in c.values()]
    assert max(first) - min(first) < 1e-6
    assert max(last) - min(last) < 1e-3


def test_bench_pipeline_against_torch_pipelining(tmp_path):
    """`bench pipeline` end to end on 2 ranks: minizero's 1F1B and ZB-H1 and torch.distributed.pipelining's
    train the same model on the same data to the same loss and gradients, and hold the same activations (one meter,
    memory.SavedTensors, around both); the table, the targets and the measured bubble are reported."""
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "bench", "pipeline", "--nprocs", "2",
                           "--steps", "2", "--warmup", "1", "--microbatches", "4", "--micro", "2",
                           "--schedules", "1f1b", "zb_h1",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    c = s["candidates"]
    assert set(c) == {f"{who}-{sched}" for who in ("minizero", "minizero-gloo", "torch") for sched in ("1f1b", "zb_h1")}
    for sched in ("1f1b", "zb_h1"):
        ref = c[f"torch-{sched}"]
        for who in ("minizero", "minizero-gloo"):
            mine = c[f"{who}-{sched}"]
            assert mine["last_loss"] == pytest.approx(ref["last_loss"], rel=1e-6)
            assert mine["saved_peak"] == ref["saved_peak"] and min(ref["saved_peak"]) > 0
            assert mine["grad_atol_vs_torch"] <= 1e-7, f"{who}-{sched}: gradients differ from torch pipelining's"
            assert len(mine["step_s"]) == 2 and mine["paired_ratio"][0] > 0
    assert c["minizero-zb_h1"]["saved_peak"][1] > c["minizero-1f1b"]["saved_peak"][1]  # ZB-H1: p on the last stage too
    assert "target minizero-1f1b / torch-1f1b <= 1.00" in proc.stdout
    for sched in ("1f1b", "zb_h1"):
        b = s["bubble"][sched]
        assert 0 < b["measured"] < 1 and b["formula"] == pytest.approx((1 / 5) if sched == "1f1b" else 1 / 13)
