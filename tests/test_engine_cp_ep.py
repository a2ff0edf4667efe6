"""The context-parallel (sequence_parallel_size, ring) and MoE (ep_size) engine keys, against one process
(one 4-rank launch: tests/engine_cp_ep_workers.py).

* sequence_parallel_size 2 (DeepSpeed's key; dp 2 x cp 2, Ulysses in TinyGPT's attention), ZeRO stages 0-3,
  and with context_parallel.attention "ring" (minizero's key: ring attention, chunks r and 2cp-1-r) at stage 1:
  the losses, the clip's global norm and every parameter after 3 SGD-momentum steps (2 micro-batches each,
  clip active) equal one process training on the whole global batch with torch's clip_grad_norm_.
  Tolerance rtol 1e-5 / atol 1e-6 in fp32: Ulysses' attention is torch's scaled_dot_product_attention on
  the whole sequence, ring attention an online softmax over blocks, the reference TinyGPT's written-out softmax, and the
  gradients are summed in another
  order (2 x 2 ranks, ring all-reduce), so the two differ by float32 rounding (measured: tests/notes).
* An MoE TinyGPT (minizero.moe.MoE with ep_size 2; 4 experts, top-2, capacity factor 1 so tokens drop) at
  stages 0 and 1 on dp 4: the same against one process that routes each rank's micro-batch as that rank does
  (capacity and l_aux are per group of tokens, GShard's), averaging the 4 losses. The expert slices of the
  two ep ranks join into the single process's experts; the clip's norm counts every expert once.
"""
import pytest
import torch

from minizero import launch
from minizero.models import GPTConfig, TinyGPT
from tests import engine_cp_ep_workers as W

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

RTOL, ATOL = 1e-5, 1e-6
_job = []


def results():
    if not _job:
        _job.append(launch.run("tests/engine_cp_ep_workers.py:run", nprocs=4, timeout=300))
    return _job[0]


def one_process(gpt: dict, dp: int, per_rank: bool):
    """SGD momentum on the global batch in this process: per micro-batch the mean loss over every token
    (per_rank: the mean of each data-parallel rank's loss, routed as that rank routes), torch's clip."""
    model = TinyGPT(GPTConfig(**{**gpt, "moe_ep_size": 1} if "num_experts" in gpt else gpt))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for step in range(W.STEPS):
        ranks = [W.micro_batches(step, dp, r) for r in range(dp)]
        total = 0.0
        for m in range(W.M):
            if per_rank:
                loss = sum(model(*ranks[r][m])[1] for r in range(dp)) / dp
            else:
                loss = model(torch.cat([ranks[r][m][0] for r in range(dp)]),
                             torch.cat([ranks[r][m][1] for r in range(dp)]))[1]
            (loss / W.M).backward()
            total += loss.item() / W.M
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), W.CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses, norms


def _close(got, want, what):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def sequence_reference():
    return one_process(W.GPT, dp=2, per_rank=False)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "ring"])
def test_sequence_parallel_size_2_trains_like_one_process(stage, sequence_reference):
    model, losses, norms = sequence_reference
    ranks = [r["sequence"][stage] for r in results()]
    assert sorted(tuple(r["coords"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # dp 2 x cp 2
    assert all(r["dp_size"] == 2 and r["dp_comm"] == 4 for r in ranks)  # batch over dp, gradients over dp x cp
    assert max(norms) > W.CLIP  # the clip acted: the norm across dp x cp is tested, not only the gradients
    init = TinyGPT(GPTConfig(**W.GPT)).state_dict()
    for r in ranks:
        _close(r["losses"], losses, "losses")
        _close(r["norms"], norms, "global norms")
        for name, p in model.state_dict().items():
            _close(r["state"][name], p.reshape(-1).tolist(), name)
    assert max((p - init[n]).abs().max().item() for n, p in model.state_dict().items()) > 1e-3  # it trained


@pytest.fixture(scope="module")
def experts_reference():
    return one_process(W.MOE, dp=4, per_rank=True)


@pytest.mark.parametrize("stage", ["0", "1"])
def test_moe_ep_size_2_trains_like_one_process_with_the_same_routing(stage, experts_reference):
    model, losses, norms = experts_reference
    ranks = results()
    assert sorted(r["experts"][stage]["ep_rank"] for r in ranks) == [0, 0, 1, 1]
    assert max(norms) > W.CLIP
    full = dict(model.named_parameters())
    for rank, r in enumerate(ranks):
        out = r["experts"][stage]
        _close(out["losses"], losses, "losses")
        _close(out["norms"], norms, "global norms (every expert once)")
        for name, flat in out["params"].items():
            want = full[name].detach()
            if name.split(".")[-1] in ("w1", "b1", "w2", "b2"):  # this rank's E/ep experts: a slice of dim 0
                local = out["shapes"][name][0]
                assert local == want.shape[0] // 2, name
                want = want[out["ep_rank"] * local:(out["ep_rank"] + 1) * local]
            _close(flat, want.reshape(-1).tolist(), f"rank {rank} {name}")
        assert "expert parallelism (ep_size=2) are not implemented" in out["refused"]
    experts = {n: full[n].detach() for n in full if ".experts." in n}
    init = TinyGPT(GPTConfig(**{**W.MOE, "moe_ep_size": 1})).state_dict()
    # the experts trained, each tensor by more than 20x the tolerance (w1 moves least: 7e-5, the clip is active)
    assert all((w - init[n]).abs().max() > 20 * ATOL for n, w in experts.items())


def test_moe_takes_deepspeeds_arguments_and_refuses_what_it_does_not_implement():
    from minizero.models import GPTMLP
    from minizero.moe import MoE
    layer = MoE(32, GPTMLP(GPTConfig(n_embd=32)), num_experts=4, ep_size=2, k=2, min_capacity=3)
    assert layer.layer.experts.w1.shape == (4, 32, 128)  # f read from the module's first Linear; all E experts
    x = torch.randn(2, 5, 32)
    out, l_aux, counts = layer(x)
    probs = torch.softmax(layer.layer.router.gate(x.reshape(10, 32)), -1)
    first = torch.bincount(probs.argmax(-1), minlength=4)
    assert out.shape == (2, 5, 32) and counts.tolist() == first.tolist()  # exp_counts: the first choices per expert
    # l_aux unscaled (DeepSpeed's: the user weighs it): E sum_i f_i P_i
    torch.testing.assert_close(l_aux, 4 * (first.float() / 10 * probs.mean(0)).sum())
    assert layer.layer.last_routing.capacity == 5  # max(min_capacity 3, ceil(2 * 10 * 1.0 / 4) = 5)
    for bad, words in (({"use_rts": True}, "use_rts=True is not implemented"), ({"ep_size": 3}, "ep_size=3 must"),
                       ({"drop_tokens": False}, "drop_tokens=False"),
                       ({"expert": torch.nn.Linear(32, 32)}, "two nn.Linear")):
        with pytest.raises(ValueError, match=words):
            MoE(**{"hidden_size": 32, "expert": 64, "num_experts": 4, **bad})
