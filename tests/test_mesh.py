"""Mesh: every group holds exactly the ranks it should, and sub-group bytes count into the world.

The expected groups are written out by hand from the layout arange(world).view(dp, pp, tp)
(tp fastest), not computed with the Mesh's own formula: a transposed axis would show here."""
from types import SimpleNamespace

import pytest

from minizero import launch
from minizero.comm import Mesh, MeshError, ring_bytes_sent

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/comm_workers.py:"

# (dp, pp, tp, node_size) -> axis -> the groups, as world ranks, written out by hand
EXPECTED = {
    (2, 2, 2, 4): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                   "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                   "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                   "node": [[0, 1, 2, 3], [4, 5, 6, 7]],
                   "cross_node": [[0, 4], [1, 5], [2, 6], [3, 7]]},
    (2, 1, 2, 2): {"tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
                   "node": [[0, 1], [2, 3]], "cross_node": [[0, 2], [1, 3]]},
    (1, 4, 1, 4): {"tp": [[0], [1], [2], [3]], "pp": [[0, 1, 2, 3]], "dp": [[0], [1], [2], [3]],
                   "node": [[0, 1, 2, 3]], "cross_node": [[0], [1], [2], [3]]},
    (2, 2, 1, 1): {"tp": [[0], [1], [2], [3]], "pp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]],
                   "node": [[0], [1], [2], [3]], "cross_node": [[0, 1, 2, 3]]},
}


def _check(results, layouts):
    for i, layout in enumerate(layouts):
        want = EXPECTED[layout]
        dp, pp, tp, _ = layout
        for rank, per_layout in enumerate(results):
            out = per_layout[i]
            for axis, groups in want.items():
                mine = next(g for g in groups if rank in g)
                assert out["members"][axis] == mine, f"{layout} rank {rank} {axis}: {out['members'][axis]} != {mine}"
                assert out["groups"][axis] == groups, f"{layout} groups({axis})"
            d, p, t = out["coords"]
            assert rank == (d * pp + p) * tp + t
            assert out["pp_prev"] == (p - 1 if p > 0 else None) and out["pp_next"] == (p + 1 if p < pp - 1 else None)
            assert out["first"] == (p == 0) and out["last"] == (p == pp - 1)
            # the dp all-reduce summed over exactly the dp group, and its bytes count in both stats
            assert out["sum"] == dp
            assert out["dp_sent"] == pytest.approx(ring_bytes_sent("all_reduce", 4000, dp))
            assert out["world_sent"] == out["dp_sent"]
            # ring model: all of it goes to the next member of the dp group; cross-node iff on another node
            dp_group, node_size = out["members"]["dp"], layout[3]
            succ = dp_group[(dp_group.index(rank) + 1) % len(dp_group)]
            assert out["world_cross"] == (out["dp_sent"] if succ // node_size != rank // node_size else 0.0)


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_mesh_4_ranks(backend):
    layouts = [(2, 1, 2, 2), (1, 4, 1, 4), (2, 2, 1, 1)]
    _check(launch.run(W + "mesh_groups", nprocs=4, args={"layouts": layouts}, backend=backend, timeout=120), layouts)


def test_mesh_8_ranks_2x2x2():
    layouts = [(2, 2, 2, 4)]
    _check(launch.run(W + "mesh_groups", nprocs=8, args={"layouts": layouts}, timeout=180), layouts)


@pytest.mark.parametrize("sizes, words", [
    (dict(dp=2, pp=2, tp=1), "dp=2 x pp=2 x tp=1 = 4 ranks, but the world has 8"),
    (dict(pp=3), "pp=3 x tp=1 = 3 does not divide the world size 8"),
    (dict(tp=4, node_size=2), "tp=4 does not fit in nodes of 2 ranks"),
    (dict(node_size=3), "node_size=3 does not divide the world size 8"),
    (dict(tp=0), "tp must be a positive int, got 0"),
    (dict(pp=2.0), "pp must be a positive int, got 2.0"),
])
def test_bad_sizes_name_the_sizes(sizes, words):
    # checked before any split: a stand-in world of 8 ranks is enough
    with pytest.raises(MeshError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Mesh(SimpleNamespace(size=8, rank=0), **sizes)
