"""Tensor and sequence parallelism (minizero.tensor) against the single-process TinyGPT.

ONE 4-rank job (tests/tensor_workers.py) runs t = 4 and t = 2 (x DDP over dp = 2), with and without
sequence parallelism, tied and untied embeddings: 8 lockstep runs of 5 SGD steps. Each returns what
it measured; the formulas it is held against are computed here or in the mechanism's own functions.

Tolerance: rtol 1e-6 with atol 2e-7 (the fp32 tolerance of docs/design.md). Only the order of the
float32 additions differs from one process: a row-parallel layer sums t partial products, the
cross-entropy sums t partial sums of exponentials. Measured: at most 7e-8 (a c_proj bias gradient).
"""
import pytest
import torch

from minizero import launch
from minizero.comm import ring_bytes_sent

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ATOL = 2e-7
CASES = [f"t{t}/sp{sp}/tied{tied}" for t in (4, 2) for sp in (0, 1) for tied in (0, 1)]
_job = []


def results(case):
    if not _job:
        _job.append(launch.run("tests/tensor_workers.py:run_all", nprocs=4, timeout=300))
    return [out[case] for out in _job[0]]


@pytest.mark.parametrize("case", CASES)
def test_logits_loss_gradients_and_5_sgd_steps_equal_one_process(case):
    for rank, r in enumerate(results(case)):
        assert r["logits"]["atol_needed"] <= ATOL, (rank, r["logits"])
        mine, ref = r["loss"]
        assert abs(mine - ref) <= 1e-6 * abs(ref) + ATOL, (rank, r["loss"])
        assert r["grads"]["atol_needed"] <= ATOL, (rank, r["grads"])
        assert r["params"]["atol_needed"] <= ATOL, (rank, r["params"])
        assert len(r["losses"]) == 5


@pytest.mark.parametrize("case", CASES)
def test_collectives_per_pass_equal_the_formula(case):
    """Calls and payload per op from comm.stats of the tp group, against collectives_per_step (2
    all-reduces per layer per pass; with SP 2 all-gathers + 2 reduce-scatters forward, 4 + 2
    backward); bytes sent against the ring formula of each op."""
    for r in results(case):
        t, formula = r["t"], r["formula"]["collectives"]
        for phase in ("forward", "backward"):
            measured = r["collectives"][phase]
            assert sorted(measured) == sorted(formula[phase]), (phase, measured, formula[phase])
            for op, (calls, payload, sent) in measured.items():
                assert [calls, payload] == formula[phase][op], (phase, op, measured[op], formula[phase][op])
                assert sent == pytest.approx(ring_bytes_sent(op, payload, t), rel=1e-12)


@pytest.mark.parametrize("t", [4, 2])
def test_sequence_parallel_forward_sends_what_tensor_parallel_sends(t):
    """A ring all-reduce IS a reduce-scatter + an all-gather: SP's forward sends exactly TP's bytes
    (measured, both). Backward sends more: the re-gathered inputs and the LayerNorm gradients."""
    for tp, sp in zip(results(f"t{t}/sp0/tied0"), results(f"t{t}/sp1/tied0")):
        sent = {name: {phase: sum(v[2] for v in r["collectives"][phase].values()) for phase in ("forward", "backward")}
                for name, r in (("tp", tp), ("sp", sp))}
        assert sent["sp"]["forward"] == sent["tp"]["forward"] > 0, sent
        assert sent["sp"]["backward"] > sent["tp"]["backward"], sent


@pytest.mark.parametrize("case", CASES)
def test_activation_memory_per_layer_equals_korthikanti(case):
    """Saved-for-backward bytes of each layer (SavedTensors) = Korthikanti's formula for fp32 without
    dropout + the LayerNorm statistics and causal mask the paper leaves out; ÷t with SP."""
    for r in results(case):
        want = r["formula"]["activation_bytes_per_layer"] + r["formula"]["unmodelled_bytes_per_layer"]
        assert r["saved_bytes"]["h.0"] == r["saved_bytes"]["h.1"] == want, (r["saved_bytes"], want)


def test_sequence_parallel_saves_what_the_formula_says():
    """The same model, t = 4: SP keeps (s*b*h/t)(16w + w*a*s/h) per layer against TP's
    s*b*h(4w + (12w + w*a*s/h)/t): measured ratio = formula ratio, and below 1."""
    tp, sp = results("t4/sp0/tied0")[0], results("t4/sp1/tied0")[0]
    measured = sp["saved_bytes"]["h.0"] / tp["saved_bytes"]["h.0"]
    formula = sp["formula"]["activation_bytes_per_layer"] / tp["formula"]["activation_bytes_per_layer"]
    assert measured < 0.7 and abs(measured - formula) < 0.02, (measured, formula)


@pytest.mark.parametrize("case", CASES)
def test_parameter_memory_is_split_t_ways(case):
    """Ledger bytes on each rank = (split / t + replicated) * 4, the split part from the
    single-process model's tensors; and < 1/t of the single-process bytes + the replicated ones."""
    for r in results(case):
        b = r["parameter_bytes"]
        assert b["ledger"] == b["per_rank"] == b["split"] / r["t"] + b["replicated"], b
        assert b["ledger"] < b["single_process"] / r["t"] + b["replicated"] + 1


# ------------------------------------------------------------------------ bad input (no collectives)
class _Comm:
    """Enough of a Communicator for construction: size, rank, device. Any collective would fail."""

    def __init__(self, size, rank=0):
        self.size, self.rank, self.device = size, rank, torch.device("cpu")


def _gpt(**kw):
    from minizero.models import GPTConfig, TinyGPT
    return TinyGPT(GPTConfig(**{**dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32), **kw}))


@pytest.mark.parametrize("kw,t,words", [
    (dict(n_head=3, n_embd=24), 2, "number of attention heads n_head=3 is not divisible by the tensor-parallel size 2"),
    (dict(vocab_size=66), 4, "vocab_size (wte.num_embeddings)=66 is not divisible by the tensor-parallel size 4"),
    (dict(n_head=2), 4, "n_head=2 is not divisible by the tensor-parallel size 4"),
])
def test_sizes_not_divisible_by_t_are_refused_and_change_nothing(kw, t, words):
    from minizero.tensor import TensorParallelGPT
    model = _gpt(**kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as e:
        TensorParallelGPT(model, _Comm(t))
    assert words in str(e.value)
    assert [type(m) for m in model.modules()] == types
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_converting_twice_is_refused():
    from minizero.tensor import TensorParallelGPT
    model = TensorParallelGPT(_gpt(), _Comm(2))
    with pytest.raises(ValueError, match="h.0 is already tensor-parallel"):
        TensorParallelGPT(model, _Comm(2))


def test_hidden_size_not_divisible_by_t():
    from minizero.tensor import ColumnParallelLinear, RowParallelLinear
    with pytest.raises(ValueError, match="out_features=10 is not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(8, 10, _Comm(4))
    with pytest.raises(ValueError, match="out_features / 3 .one block of the fused layer.=6 is not divisible"):
        ColumnParallelLinear(8, 18, _Comm(4), chunks=3)
    with pytest.raises(ValueError, match="in_features=6 is not divisible by the tensor-parallel size 4"):
        RowParallelLinear(6, 8, _Comm(4))
    from minizero.tensor.blocks import check_block
    with pytest.raises(ValueError, match="MLP hidden size"):
        block = _gpt(n_head=4).h[0]
        block.mlp.c_fc = torch.nn.Linear(32, 30)
        check_block(block, 4)


def test_sequence_length_not_divisible_by_t_with_sp():
    """Refused in forward, before any collective (the fake comm has none to call)."""
    from minizero.tensor import TensorParallelGPT
    model = TensorParallelGPT(_gpt(), _Comm(4), sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by the tensor-parallel size 4"):
        model(torch.zeros(2, 10, dtype=torch.long))


def test_tp_size_not_dividing_the_world_is_a_mesh_error():
    from minizero.comm import Mesh, MeshError
    with pytest.raises(MeshError, match="tp=3 = 3 does not divide the world size 4"):
        Mesh(_Comm(4), tp=3)


def test_shard_and_unshard_are_inverse_with_fused_blocks():
    from minizero.tensor import shard, unshard
    full = torch.arange(24.0).view(12, 2)  # [q | k | v], 4 rows each
    pieces = [shard(full, 0, r, 2, chunks=3) for r in range(2)]
    assert pieces[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]  # rows 0-1 of q, of k, of v
    assert torch.equal(unshard(pieces, 0, chunks=3), full)
    cols = [shard(full.t(), 1, r, 4) for r in range(4)]
    assert torch.equal(unshard(cols, 1), full.t())


# ------------------------------------------------------------------------ the engine: dp=2 x tp=2, ZeRO 0-3
@pytest.mark.parametrize("run", ["stage0/sp1", "stage1/sp1", "stage2/sp1", "stage3/sp0"])
def test_engine_tp2_over_zero_stages_equals_one_process(run):
    """tensor_parallel.autotp_size = 2 on 4 ranks: DDP / ZeRO-1/2/3 over mesh.dp (2 ranks), the model
    split over mesh.tp, 2 accumulated micro-batches, clipping at 0.3 (active: the norms are ~1): the
    full model's gradient norm and the parameters after 3 SGD-momentum steps equal one process's."""
    if not _job:
        results(CASES[0])
    for rank, out in enumerate(_job[0]):
        r = out["engine"][run]
        assert r["tp"] == [rank % 2, 2] and r["dp"] == [rank // 2, 2] and r["train_batch_size"] == 8
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6) and min(r["norms"]) > 0.3
        assert r["params"]["atol_needed"] <= ATOL, (rank, r["params"])


def test_engine_config_errors_before_any_collective(tmp_path):
    from minizero.runtime.config import ConfigError, load_config
    from minizero.runtime.resolve import resolve
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match="autotp_size=3 does not divide the world size 4"):
        load_config({**base, "tensor_parallel": {"autotp_size": 3}}, world_size=4)
    cfg = load_config({**base, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    assert cfg["train_batch_size"] == 4  # micro x accumulation x the 2 data-parallel ranks, as DeepSpeed
    resolve(cfg, 4)
    from minizero.models import MLP
    with pytest.raises(ConfigError, match="nanoGPT-named model .* MLP has no wte, wpe, h, ln_f, lm_head"):
        resolve(cfg, 4, MLP())
    sp3 = {**base, "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}
    with pytest.raises(ConfigError, match="sequence_parallel with zero_optimization.stage 3"):
        resolve(sp3, 4, _gpt())
    with pytest.raises(ConfigError, match="sequence_parallel needs tensor_parallel.autotp_size > 1"):
        resolve(load_config({**base, "tensor_parallel": {"sequence_parallel": True}}, world_size=4), 4)
    with pytest.raises(ConfigError, match="'tensor_parallel.autotp_size' must be at least 1, got 0"):
        load_config({**base, "tensor_parallel": {"autotp_size": 0}}, world_size=4)
    for stage, device in [(2, "cpu"), (3, "nvme")]:
        off = load_config({**base, "zero_optimization": {"stage": stage, "offload_optimizer": {
            "device": device, "nvme_path": str(tmp_path)}}, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
        with pytest.raises(ConfigError, match="with zero_optimization.offload_optimizer: offload with tensor parallel"):
            resolve(off, 4, _gpt())
    from minizero.zero import Init
    with Init():
        meta_model = _gpt()
    z3 = load_config({**base, "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    with pytest.raises(ConfigError, match="with a model built under zero.Init"):
        resolve(z3, 4, meta_model)


# ------------------------------------------------------------------------ bench --tp, against torch DTensor TP
def test_bench_tp_against_dtensor(monkeypatch, tmp_path, capsys):
    """`python -m minizero_course bench --tp` end to end on the shared job's results (its launch.run returns
    them): the same model under torch's DTensor TP (parallelize_module, loss_parallel) gives the same
    first loss (a ground-truth check of minizero's TP), the same parameter bytes per rank, 2 all-reduces
    per layer per pass in both (DTensor's loss takes 3, minizero's 2), and the report, JSON and plot."""
    import json

    from minizero_course.bench import bench
    if not _job:
        results(CASES[0])
    per_rank = [out["bench"] for out in _job[0]]
    monkeypatch.setattr(launch, "run", lambda *a, **k: per_rank)
    out_json, png = tmp_path / "tp.json", tmp_path / "tp.png"
    assert bench.main(["--tp", "--nprocs", "4", "--json", str(out_json), "--plot", str(png)]) == 0
    assert "t=2: minizero TP no slower than torch DTensor TP: paired ratio" in capsys.readouterr().out
    s = json.loads(out_json.read_text())
    row = s["t"]["2"]
    assert row["first_loss_diff"] <= 1e-6, row["first_loss_diff"]
    mine, theirs = row["candidates"]["minizero-tp"], row["candidates"]["dtensor-tp"]
    n_layer = 2
    assert mine["collectives"] == {"all_reduce": 4 * n_layer + 4}  # + embedding, lm_head's f, loss (2)
    assert theirs["collectives"] == {"all_reduce": 4 * n_layer + 5}  # loss_parallel: 3 all-reduces
    for a, b in zip(mine["ledger"], theirs["ledger"]):
        assert a["parameters"] == b["parameters"] > 0
    assert png.exists() and png.stat().st_size > 10_000
