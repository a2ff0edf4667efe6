"""Across nodes: the Mesh's nodes are the launcher's (comm/mesh.py, comm/launcher.py).

ONE job: two torchrun agents on this machine are two nodes of 2 ranks (`--nnodes 2 --node-rank 0/1
--nproc-per-node 2`, c10d rendezvous on 127.0.0.1, a free port), running tests/nodes_workers.py. The
nodes expected here are the ones torchrun made, read from outside minizero: the ranks whose parent is the
same agent process. Every group the job built from a Mesh without node_size (the nodes, TP, hpZ's, hybrid
sharding's) must hold those ranks, and comm.stats' cross-node bytes of one step must equal the ring
formula for nodes of that size (zeropp.formula, hybrid.cross_node_bytes_per_node: from the units' sizes,
never from comm.stats). The launch runs under a timeout in a private TMPDIR, and the test checks that no
process and no job directory is left; a rank that fails is named with its traceback.
The rest (the launchers' variables, uneven and interleaved nodes) needs no launch: a stand-in communicator.
"""
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

from minizero.comm import Mesh, MeshError
from minizero.comm.launcher import LOCAL_SIZE_ENV, local_world_size, node_name
from minizero.comm.mesh import nodes_from_launcher
from minizero_course.experiments.zeropp import formula, measured_per_node
from minizero.zero.hybrid import cross_node_bytes_per_node
from tests.test_faults import _job

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
K, NODES = 2, 2  # what the command line asks torchrun for
_cache = {}


def _agent(node, port, out):
    return (f"{TORCHRUN} --nnodes {NODES} --node-rank {node} --nproc-per-node {K} --rdzv-backend c10d "
            f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-id nodes --rdzv-conf is_host={int(node == 0)} "
            f"--log-dir {out}/torchrun{node} tests/nodes_workers.py {out}")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    """Per-rank results of the two-agent job (rank order), launched once."""
    if "job" not in _cache:
        tmp = tmp_path_factory.mktemp("nodes")
        out = tmp / "out"
        out.mkdir()
        port = get_free_port()
        script = (f"{_agent(0, port, out)} & first=$!; {_agent(1, port, out)}; second=$?; wait $first; exit $(($? | "
                  "second))")
        try:
            code, text, left, pids = _job(["bash", "-c", script], tmp, timeout=300)
        except subprocess.TimeoutExpired:
            done = sorted(int(f.stem[4:]) for f in out.glob("rank*.json"))
            pytest.fail(f"the two-node job did not end within 300 s; ranks that finished: {done} of 0-{NODES * K - 1}")
        failed = sorted(out.glob("rank*.err"), key=lambda f: f.stat().st_mtime)  # the first to fail is the cause
        assert not failed, (f"rank {failed[0].stem[4:]} failed first:\n{failed[0].read_text()}\nthen ranks "
                            f"{[int(f.stem[4:]) for f in failed[1:]]}; the agents' output:\n{text[-2000:]}")
        assert code == 0, text[-3000:]
        assert left == [] and pids == [], (left, pids)  # no minizero-job-* directory, no live process
        _cache["job"] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES * K)]
    return _cache["job"]


def _torchrun_nodes(res):
    """The nodes as torchrun made them: ranks grouped by their agent (parent) process."""
    nodes = {}
    for r in res:
        nodes.setdefault(r["agent"], []).append(r["rank"])
    return sorted(nodes.values())


def _node_of(res, rank):
    return next(node for node in _torchrun_nodes(res) if rank in node)


def test_the_mesh_takes_torchruns_nodes_and_an_explicit_node_size_wins(res):
    nodes = _torchrun_nodes(res)
    assert [len(n) for n in nodes] == [K] * NODES, nodes  # torchrun did make 2 nodes of 2
    for r in res:
        mesh = r["mesh"]
        assert (mesh["source"], mesh["node_size"]) == ("launcher", K), (r["rank"], mesh)
        assert mesh["node"] == _node_of(res, r["rank"]) and mesh["groups"] == nodes, (r["rank"], mesh)
        index = _node_of(res, r["rank"]).index(r["rank"])
        assert mesh["cross_node"] == [node[index] for node in nodes], (r["rank"], mesh)
        assert r["explicit"] == {"node_size": 4, "source": "node_size", "node": [0, 1, 2, 3]}, r["rank"]


def test_tp_groups_are_the_nodes_and_a_tp_wider_than_a_node_is_refused(res):
    for r in res:
        tp, node = r["tp"], _node_of(res, r["rank"])
        assert tp["source"] == "launcher" and tp["tp"] == node and tp["groups"] == _torchrun_nodes(res), r["rank"]
        assert len({_node_of(res, d)[0] for d in tp["dp"]}) == NODES, (r["rank"], tp)  # dp: one rank per node
        assert r["tp4"] is not None and "tp=4 does not fit in nodes of 2 ranks (the launcher's" in r["tp4"], r["tp4"]


def test_hpz_and_hybrid_sharding_group_by_the_nodes(res):
    for r in res:
        node, v = _node_of(res, r["rank"]), r["variants"]
        for name in ("+hpZ", "ZeRO++"):
            assert v[name]["groups"]["node"] == node, (r["rank"], name)
            # hpZ's secondary partition: 1/k of every unit, k = torchrun's ranks per node
            assert v[name]["secondary_numel"] == sum(v[name]["gathered_numel"]) // len(node), (r["rank"], name)
        assert v["hybrid"]["groups"]["shard"] == node, r["rank"]
        assert v["hybrid"]["groups"]["replicas"] == r["mesh"]["cross_node"], r["rank"]


def test_cross_node_bytes_of_one_step_equal_the_formula_on_torchruns_nodes(res):
    """Per node (torchrun's), summed over its ranks: {collective: [intra, cross]} as the ring formula says."""
    n = len(res)
    gathered = res[0]["variants"]["+hpZ"]["gathered_numel"]
    for node in _torchrun_nodes(res):
        k = len(node)
        for name in ("+hpZ", "ZeRO++"):
            measured = measured_per_node([res[rank] for rank in node], name, k)[0]
            want = formula(name, gathered, n, k, elem_bytes=4)
            assert measured == {c: pytest.approx(b, abs=1e-6) for c, b in want.items()}, (node, name, measured)
            assert sum(c for _, c in measured.values()) > 0  # the nodes are real: something crosses
        # hybrid: only the gradient shards' all-reduce over the replicas crosses; gathers and reduce-scatter stay in
        hybrid = [res[rank]["variants"]["hybrid"] for rank in node]
        intra, cross = (sum(b[i] for v in hybrid for phase in ("forward", "backward") for b in v[phase].values())
                        for i in (0, 1))
        M = 4 * sum(hybrid[0]["gathered_numel"])  # its units are padded to a multiple of k, not of n
        assert cross == pytest.approx(cross_node_bytes_per_node(hybrid[0]["gathered_numel"], n // k, k, 4),
                                      rel=1e-12), (node, cross)
        assert intra == pytest.approx(k * 3 * (k - 1) / k * M, rel=1e-12), (node, intra)  # 2 all-gathers + 1 RS


# ---------------------------------------------------------------------------- no launch needed
def _launched(monkeypatch, rank=0, size=4, **env):
    for var in (*LOCAL_SIZE_ENV, "GROUP_RANK", "PMI_HOSTNAME", "RANK", "WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"PMI_RANK": rank, "PMI_SIZE": size, **env}.items():
        monkeypatch.setenv(var, str(value))


def _stand_in(names):
    """A world whose all-gather of node names returns `names`, and that can do nothing else."""
    return SimpleNamespace(size=len(names), rank=0, allgather_object=lambda mine: list(names))


@pytest.mark.parametrize("var", ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_each_launchers_local_size_is_read(var, monkeypatch):
    _launched(monkeypatch, **{var: 3})
    assert local_world_size() == 3


def test_node_names_torchrun_group_rank_then_mpich_host_then_hostname(monkeypatch):
    _launched(monkeypatch)
    assert node_name() == socket.gethostname()
    monkeypatch.setenv("PMI_HOSTNAME", "host-b")
    assert node_name() == "host-b"
    monkeypatch.setenv("GROUP_RANK", "1")  # two torchrun agents on one host are two nodes
    assert node_name() == "torchrun node 1"


def test_one_machine_is_one_node_without_a_collective(monkeypatch):
    _launched(monkeypatch, MPI_LOCALNRANKS=4)  # plain mpirun -n 4: local size = world
    assert nodes_from_launcher(SimpleNamespace(size=4, rank=0)) == 4  # no allgather_object to call


def test_a_hostfile_layout_gives_nodes_of_its_ranks_per_host(monkeypatch):
    _launched(monkeypatch, MPI_LOCALNRANKS=2, PMI_HOSTNAME="a")  # mpirun -f hostfile -ppn 2
    assert nodes_from_launcher(_stand_in(["a", "a", "b", "b", "c", "c"])) == 2


@pytest.mark.parametrize("names, words", [
    (["a", "a", "a", "b"], "the launcher's nodes hold different numbers of ranks (a: ranks [0, 1, 2]; b: ranks [3])"),
    (["a", "b", "a", "b"],
     "the launcher's nodes are not consecutive blocks of ranks (a: ranks [0, 2]; b: ranks [1, 3])"),
])
def test_uneven_or_interleaved_nodes_are_a_mesh_error_before_any_split(names, words, monkeypatch):
    _launched(monkeypatch, MPI_LOCALNRANKS=2)
    with pytest.raises(MeshError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        Mesh(_stand_in(names))  # the stand-in cannot split: the error comes first
