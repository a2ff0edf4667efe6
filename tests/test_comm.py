"""Every collective at N = 1..4 on both backends, against numpy, with ring-model byte counts."""
import pytest

from minizero import launch
from minizero.comm import ring_bytes_sent

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/comm_workers.py:"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_both_backends_agree(n):
    per_backend = {}
    for backend in ("mpi", "torch"):
        res = launch.run(W + "every_collective", nprocs=n, backend=backend, timeout=120)
        for r, out in enumerate(res):
            assert out["backend"] == backend
            assert out["bad"] == [], f"{backend} rank {r} at N={n}: {out['bad']}"
            # the counter equals the ring formula, summed independently by the worker
            assert out["sent"] == pytest.approx(out["expected_sent"], rel=1e-12)
        per_backend[backend] = [out["stats"] for out in res]
    assert per_backend["mpi"] == per_backend["torch"], "stats differ between backends"


@pytest.mark.parametrize("n", [1, 3])
def test_every_collective_staged_through_the_host(n):
    """The mpi backend's host staging (CUDA tensors of ranks sharing one GPU), forced on CPU tensors."""
    plain = launch.run(W + "every_collective", nprocs=n, backend="mpi", timeout=120)
    staged = launch.run(W + "every_collective_staged", nprocs=n, backend="mpi", timeout=120)
    for r, out in enumerate(staged):
        assert out["bad"] == [], f"staged rank {r} at N={n}: {out['bad']}"
        assert out["stats"] == plain[r]["stats"]


def test_ring_formula_values():
    S = 1_000_000
    assert ring_bytes_sent("all_reduce", S, 4) == 1_500_000
    assert ring_bytes_sent("reduce_scatter", S, 4) == 750_000
    assert ring_bytes_sent("all_gather", S, 2) == 500_000
    assert ring_bytes_sent("all_reduce", S, 1) == 0
    assert ring_bytes_sent("send", S, 4) == S


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_subgroups_and_rollup(backend):
    res = launch.run(W + "subgroups", nprocs=4, backend=backend, timeout=60)
    for r, out in enumerate(res):
        assert out["sub_size"] == 2 and out["sub_rank"] == r // 2
        assert out["sum"] == (0 + 2 if r % 2 == 0 else 1 + 3)
        assert out["pair"] == (2.0 if r < 2 else 1.0)
        # the sub-group's bytes are also counted in the world's stats
        assert out["world_sent"] >= out["sub_sent"] > 0


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_barrier_with_sleep_s_waits_asleep_and_counts_no_bytes(backend):
    res = launch.run(W + "sleeping_barrier", nprocs=2, backend=backend, timeout=60)
    early = res[1]  # rank 1 waited about 0.3 s for rank 0, polling and sleeping in between
    assert early["wall"] > 0.2 and early["cpu"] < early["wall"] / 2
    for out in res:
        assert out["barrier"]["calls"] == 2 and out["barrier"]["payload_bytes"] == 0 and out["sent"] == 0


def test_local_shape_mismatch_names_op_and_shapes():
    with pytest.raises(launch.RankError) as e:
        launch.run(W + "shape_mismatch_local", nprocs=2, timeout=60)
    msg = str(e.value)
    assert "reduce_scatter" in msg and "(7,)" in msg and "(3,)" in msg


def test_cross_rank_shape_mismatch_detected_in_debug_mode():
    with pytest.raises(launch.RankError) as e:
        launch.run(W + "shape_mismatch_across_ranks", nprocs=2, timeout=60)
    assert "ranks disagree" in str(e.value) and "(10,)" in str(e.value) and "(11,)" in str(e.value)


def test_wraps_an_existing_torch_distributed_group(tmp_path):
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "tests/spawn_existing_group.py", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert (got["backend"], got["rank"], got["size"], got["total"]) == ("torch", r, 3, 6.0)
        assert got["gathered"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert got["sent"] == ring_bytes_sent("all_reduce", 24, 3) + ring_bytes_sent("all_gather", 24, 3)


@pytest.mark.parametrize("which,who", [("zero1", "ShardedOptimizer"), ("zero2", "ShardGradOp"), ("zero3", "FSDP")])
def test_zero_debug_flag_detects_parameters_differing_across_ranks(which, who):
    with pytest.raises(launch.RankError) as e:
        launch.run(W + "differing_params_under_zero", nprocs=2, args={"which": which}, timeout=60)
    assert f"{who}(debug=True): parameter" in str(e.value) and "differs between rank" in str(e.value)
