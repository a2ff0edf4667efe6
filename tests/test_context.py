"""Context parallelism (minizero.context) against torch's scaled_dot_product_attention on one process.

ONE 4-rank job (tests/context_workers.py) runs cp = 4 and cp = 2 (x dp = 2): ring attention causal
with and without load balancing and not causal, Ulysses causal and not: outputs and dq, dk, dv
gathered from the shards, bytes per pass, saved activations and the work of every rank.

Tolerance (float32): rtol 1e-6 with atol 5e-6. Ring attention computes the same sums in another
order: each block's softmax is normalized by its own log-sum-exp and rescaled by exp(L_B - L) when
merged, so every output and gradient element carries a few float32 roundings of O(1) values more
(measured: at most 2.1e-6, a dv element, non-causal). In float64 the same runs agree to 1e-12: the
algorithm is exact, only rounding differs. Ulysses runs torch's own attention on whole heads:
bitwise equal (atol 0).
"""
import pytest
import torch

from minizero import launch
from tests.context_workers import CASES, case_name

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ATOL = 5e-6
_job = []


def results(key):
    if not _job:
        _job.append(launch.run("tests/context_workers.py:run_all", nprocs=4, timeout=300))
    return [out[key] for out in _job[0]]


def _ranks(cp):
    """The ranks of the first cp group: cp = 2 has two groups (dp = 2), the same measurements."""
    return range(cp)


NAMES = [(cp, *case) for cp in (4, 2) for case in CASES]


@pytest.mark.parametrize("cp,method,causal,balanced", NAMES, ids=[case_name(*n) for n in NAMES])
def test_output_and_gradients_equal_one_process(cp, method, causal, balanced):
    for rank, r in enumerate(results(case_name(cp, method, causal, balanced))):
        limit = 0.0 if method == "ulysses" else ATOL
        for what, need in r["atol_needed"].items():
            assert need <= limit, (rank, what, r["atol_needed"], r["max_diff"])
        if method == "ring":  # not bitwise: a real reordering happened (a pass-through would be 0)
            assert max(r["max_diff"].values()) > 0, r["max_diff"]


@pytest.mark.parametrize("cp", [4, 2])
def test_float64_ring_attention_is_exact(cp):
    for r in results(f"cp{cp}/ring/causal/balanced/float64"):
        assert max(r["max_diff"].values()) < 1e-12, r["max_diff"]


@pytest.mark.parametrize("cp,method,causal,balanced", NAMES, ids=[case_name(*n) for n in NAMES])
def test_bytes_per_pass_equal_the_formula(cp, method, causal, balanced):
    """comm.stats of the cp group, forward and backward, against ring_bytes_per_layer (sends) or
    ulysses_bytes_per_layer (all-to-alls)."""
    op = "send" if method == "ring" else "all_to_all"
    for r in results(case_name(cp, method, causal, balanced)):
        for phase in ("forward", "backward"):
            sent = r["sent"][phase]
            assert sent.get(op, 0) == pytest.approx(r["formula"][phase], rel=1e-12) and r["formula"][phase] > 0, (
                phase, sent, r["formula"])
            assert sum(sent.values()) == sent[op], sent  # nothing else travelled


def test_ulysses_sends_less_than_the_ring_and_falls_with_cp():
    """Per layer (both passes): measured ring bytes grow towards 6bsh·w, Ulysses' fall as 1/cp."""
    total = {(m, cp): sum(sum(p.values()) for p in results(case_name(cp, m, True, m == "ring"))[0]["sent"].values())
             for m in ("ring", "ulysses") for cp in (2, 4)}
    assert total["ulysses", 4] < total["ulysses", 2] < total["ring", 2] < total["ring", 4], total


@pytest.mark.parametrize("cp,method,causal,balanced", NAMES, ids=[case_name(*n) for n in NAMES])
def test_saved_activations_are_one_cp_th(cp, method, causal, balanced):
    """Bytes autograd keeps (SavedTensors) = q, k, v, o and the fp32 log-sum-exp of s/cp tokens."""
    for r in results(case_name(cp, method, causal, balanced)):
        assert r["saved_bytes"] == r["formula"]["saved_bytes"], (r["saved_bytes"], r["formula"]["saved_bytes"])
    one = results(case_name(4, method, causal, balanced))[0]["saved_bytes"]
    two = results(case_name(2, method, causal, balanced))[0]["saved_bytes"]
    assert two == 2 * one


@pytest.mark.parametrize("cp", [4, 2])
def test_causal_work_is_uneven_without_load_balancing_and_even_with_it(cp):
    """Scores each rank really computed (BlockWork): contiguous shards give rank r (r + 1) blocks,
    the mirrored chunks the same 2cp + 1 chunk pairs to every rank; both = layout.scores_per_rank."""
    contiguous = [r["work"] for r in results(case_name(cp, "ring", True, False))][:cp]
    balanced = [r["work"] for r in results(case_name(cp, "ring", True, True))][:cp]
    formula = results(case_name(cp, "ring", True, False))[0]["formula"]["scores_per_rank"]
    assert [w["forward_scores"] for w in contiguous] == formula
    assert max(formula) == cp * min(formula)
    scores = [w["forward_scores"] for w in balanced]
    assert len(set(scores)) == 1 and scores == results(case_name(cp, "ring", True,
                                                                 True))[0]["formula"]["scores_per_rank"]
    assert sum(scores) < sum(formula)  # the diagonal chunks are smaller: less masked work in total
    assert all(w["pairs"]["skip"] == 2 * cp - 1 and w["backward_scores"] == w["forward_scores"] for w in balanced)


def test_cp_groups_of_the_mesh():
    """Hand-written from arange(4).view(dp, pp, cp, tp): cp varies faster than dp."""
    for rank, r in enumerate(results("cp2/group")):
        assert r["groups"] == [[0, 1], [2, 3]] and r["dp"] == [[0, 2], [1, 3]], r
        assert r["members"] == ([0, 1] if rank < 2 else [2, 3]) and r["coords"] == [rank // 2, 0, rank % 2, 0]
    assert all(r["groups"] == [[0, 1, 2, 3]] and r["members"] == [0, 1, 2, 3] for r in results("cp4/group"))


_job8 = []


def results_8():
    if not _job8:
        _job8.append(launch.run("tests/context_workers.py:run_8", nprocs=8, timeout=300))
    return _job8[0]


def test_cp_inside_dp_x_cp_x_tp_on_8_ranks():
    """Groups hand-written from arange(8).view(dp 2, pp 1, cp 2, tp 2); ring attention and Ulysses on
    each cp group equal one process and send the formula's bytes."""
    for rank, r in enumerate(results_8()):
        assert r["groups"] == {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                               "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}, r["groups"]
        assert r["coords"] == [rank // 4, 0, rank // 2 % 2, rank % 2]
        for method in ("ring", "ulysses"):
            m = r[method]
            assert max(m["atol_needed"].values()) <= (ATOL if method == "ring" else 0.0), (rank, method, m["max_diff"])
            for phase in ("forward", "backward"):
                assert sum(m["sent"][phase].values()) == pytest.approx(m["formula"][phase], rel=1e-12), (method, phase)


PEER_ERRORS = {  # what docs/context-experts.md quotes: torch's context_parallel on CPU/gloo, torch 2.13
    "FLASH_ATTENTION": "does not have a sharding strategy registered",
    "MATH": "got mixed torch.Tensor and DTensor"}


def test_torch_backend_and_torch_context_parallel_peer():
    """One 2-rank job on torch.distributed (gloo): both methods equal one process there too; torch's
    own context_parallel either fails with the error docs/context-experts.md quotes, or (a torch that runs it on
    CPU) equals one process within the same tolerance as ours."""
    runs = launch.run("tests/context_workers.py:run_torch", nprocs=2, backend="torch", timeout=300)
    for rank, r in enumerate(runs):
        assert r["backend"] == "torch"
        for method in ("ring", "ulysses"):
            m = r[method]
            assert max(m["atol_needed"].values()) <= (ATOL if method == "ring" else 0.0), (rank, method, m["max_diff"])
            assert sum(m["sent"]["forward"].values()) == pytest.approx(m["formula"]["forward"], rel=1e-12)
        for backend, words in PEER_ERRORS.items():
            peer = r["peer"][backend]
            if "error" in peer:
                assert words in peer["error"], (backend, peer)
            else:
                assert max(peer["max_diff"].values()) <= ATOL, (backend, peer)


# ------------------------------------------------------------------------ bad input (no collectives)
class _Comm:
    """size and rank only: any collective would fail."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


def test_ulysses_refuses_heads_not_divisible_by_cp():
    from minizero.context import ulysses_attention
    q = torch.zeros(1, 6, 8, 4)
    with pytest.raises(ValueError, match="Ulysses: 6 attention heads are not divisible by the context-parallel size 4"):
        ulysses_attention(q, q, q, _Comm(4))


@pytest.mark.parametrize("seq,cp,balanced,words", [(12, 4, True, "not divisible into 2 x cp = 8 chunks"),
                                                   (10, 4, False, "not divisible into cp = 4 shards")])
def test_sequences_that_do_not_split_are_refused(seq, cp, balanced, words):
    from minizero.context import shard_sequence
    with pytest.raises(ValueError, match=words):
        shard_sequence(torch.zeros(1, 2, seq, 4), 0, cp, balanced)


def test_unshard_inverts_shard():
    from minizero.context import shard_sequence, unshard_sequence
    x = torch.arange(16.0).view(1, 1, 16, 1)
    for balanced in (True, False):
        parts = [shard_sequence(x, r, 4, balanced) for r in range(4)]
        assert torch.equal(unshard_sequence(parts, balanced), x)
    assert shard_sequence(x, 1, 4, True).flatten().tolist() == [2.0, 3.0, 12.0, 13.0]  # chunks 1 and 6
