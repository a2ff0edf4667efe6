"""Lesson 01's measuring tools: the alpha-beta fit, the ring formula, and AR == RS + AG."""
import numpy as np
import pytest

from minizero import launch
from minizero_course.experiments.collectives import bandwidth_table, fit_alpha_beta, ring_time

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

SIZES = np.array([2.0**k for k in range(10, 24)])


def test_fit_recovers_alpha_beta_of_a_line():
    alpha, beta = 5e-6, 1 / 8e9  # 5 us latency, 8 GB/s
    a, b = fit_alpha_beta(SIZES, alpha + SIZES * beta)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)


def test_fit_with_noise_stays_close():
    rng = np.random.default_rng(0)
    t = (2e-5 + SIZES * 1e-10) * rng.uniform(0.97, 1.03, SIZES.size)
    a, b = fit_alpha_beta(SIZES, t)
    assert a == pytest.approx(2e-5, rel=0.1) and b == pytest.approx(1e-10, rel=0.1)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("N", [2, 3, 8])
def test_fit_of_ring_model_recovers_per_step_alpha_beta(op, N):
    t = [ring_time(op, S, N, 3e-6, 2e-10) for S in SIZES]
    a, b = fit_alpha_beta(SIZES, t, op=op, N=N)
    assert a == pytest.approx(3e-6, rel=1e-9) and b == pytest.approx(2e-10, rel=1e-9)


def test_ring_time_formula():
    # all-reduce: 2(N-1) steps of (alpha + S/N beta)
    assert ring_time("all_reduce", 400, 4, 1.0, 0.01) == pytest.approx(2 * 3 * (1 + 100 * 0.01))
    assert ring_time("reduce_scatter", 400, 4, 1.0, 0.01) == pytest.approx(3 * 2.0)
    assert ring_time("all_gather", 400, 4, 1.0, 0.01) == pytest.approx(3 * 2.0)
    assert ring_time("all_reduce", 1e9, 1, 1.0, 1.0) == 0  # one rank: nothing to send
    # all-reduce = reduce-scatter + all-gather, for any N
    for N in (2, 5, 64):
        assert ring_time("all_reduce", 1e6, N, 1e-6, 1e-9) == pytest.approx(
            ring_time("reduce_scatter", 1e6, N, 1e-6, 1e-9) + ring_time("all_gather", 1e6, N, 1e-6, 1e-9))
    # the bandwidth term tends to 2*S*beta: per-rank cost barely grows with N
    assert ring_time("all_reduce", 1e9, 1024, 0, 1e-9) == pytest.approx(2.0, rel=1e-3)


def test_bandwidth_table_uses_sent_bytes_for_busbw():
    res = {"N": 4, "backend": "mpi", "rows": [
        {"op": "all_reduce", "size": 2**20, "time": 1e-3, "best": 5e-4, "sent": 1.5 * 2**20}]}
    line = bandwidth_table(res).splitlines()[-1].split()
    assert line[:4] == ["1", "MiB", "1000.0", "500.0"]  # size, median and best time in us
    assert float(line[4]) == pytest.approx(2**20 / 5e-4 / 1e9, abs=0.01)        # algbw, from the best time
    assert float(line[5]) == pytest.approx(1.5 * 2**20 / 5e-4 / 1e9, abs=0.01)  # busbw, from the best time


def test_all_reduce_is_reduce_scatter_plus_all_gather_on_3_ranks():
    # n = 1001 is not a multiple of 3: the padding path is exercised too
    res = launch.run("minizero_course.experiments.collectives:decompose_all_reduce", nprocs=3,
                     args={"n": 1001, "repeats": 1}, timeout=60)
    for r in res:
        assert r["N"] == 3 and r["payload"] == 1002 * 4
        assert r["max_abs_diff"] == 0.0
        assert r["sent_rs_ag"] == r["sent_all_reduce"] == pytest.approx(2 * 2 / 3 * 1002 * 4)


def test_time_collectives_reports_ring_bytes_from_comm_stats():
    res = launch.run("minizero_course.experiments.collectives:time_collectives", nprocs=2, timeout=60,
                     args={"sizes_bytes": [4096, 65536], "repeats": 2, "warmup": 1})
    r0 = res[0]
    assert r0["N"] == 2 and r0["backend"] == "mpi" and len(r0["rows"]) == 6
    for row in r0["rows"]:
        factor = 2 if row["op"] == "all_reduce" else 1
        assert row["sent"] == factor * (2 - 1) / 2 * row["size"]
        assert 0 < row["best"] <= row["time"]
    assert res[1]["rows"] == r0["rows"]  # every rank reports the slowest rank's times
