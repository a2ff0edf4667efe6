"""minizero.memory: the estimator against the paper, the ledger against hand counts."""
import json

import pytest
import torch
from torch import nn

from minizero import memory
from minizero.memory import (Ledger, activation_bytes, estimate, inference_bytes, measure,
                             transient, zero_paper_table1)

# Table 1 of the ZeRO paper, 7.5B column, as printed (copied here, not imported, so the
# test does not compare the code with itself).
PAPER = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
         64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}


@pytest.fixture(autouse=True)
def clean_transient():
    transient.reset()
    yield
    transient.reset()


# ------------------------------------------------------------------ estimator

def test_zero_paper_table1_reproduced_within_rounding():
    rows = zero_paper_table1()
    assert [r.n for r in rows] == [1, 4, 16, 64, 256, 1024]
    for row in rows:
        for got, paper in zip((row.os, row.os_g, row.os_g_p), PAPER[row.n]):
            assert abs(got - paper) <= 0.05 or abs(got - paper) <= 0.01 * paper, (row, paper)


def test_estimate_components_7b_on_4():
    psi, gb = 7e9, 1e9
    ddp = estimate(psi, 4, 0)
    assert (ddp.parameters, ddp.gradients, ddp.optimizer_state) == (14 * gb, 14 * gb, 84 * gb)
    assert ddp.total == 112 * gb and ddp.host == 0 and ddp.device == ddp.total
    z1, z2, z3 = (estimate(psi, 4, s) for s in (1, 2, 3))
    assert (z1.parameters, z1.gradients, z1.optimizer_state) == (14 * gb, 14 * gb, 21 * gb)
    assert (z2.parameters, z2.gradients, z2.optimizer_state) == (14 * gb, 3.5 * gb, 21 * gb)
    assert (z3.parameters, z3.gradients, z3.optimizer_state) == (3.5 * gb, 3.5 * gb, 21 * gb)
    assert ddp.total > z1.total > z2.total > z3.total == 28 * gb


def test_estimate_generalised_precisions_offload_and_hpz():
    # fp32 Adam, no master copy: 4 + 4 + 8 = 16 bytes per parameter, like mixed precision.
    e = estimate(1000, 1, 0, k=8, param_bytes=4, grad_bytes=4)
    assert (e.parameters, e.gradients, e.optimizer_state) == (4000, 4000, 8000)
    # ZeRO-Offload (Ren et al. 2021): master, state and the fp32 gradient partition on the host; the 16-bit
    # gradients leave the device bucket by bucket in backward, so stage 2 keeps only its 2Ψ parameters.
    e = estimate(8e9, 8, 2, offload_optimizer=True)
    assert e.host == (4 + 8 + 4) * 1e9 and e.device == 16e9
    e = estimate(8e9, 8, 3, offload_optimizer=True, offload_param=True)
    assert e.host == 2e9 + (4 + 8 + 4) * 1e9 and e.device == 0
    e = estimate(8e9, 8, 3, offload_optimizer=True)
    assert e.device == 2e9  # the 16-bit parameter shard
    # hpZ: a secondary 16-bit shard within groups of 4 adds 2Ψ/4; size 1 means off.
    assert estimate(8e9, 16, 3, hpz_partition_size=4).parameters == 1e9 + 4e9
    assert estimate(8e9, 16, 3, hpz_partition_size=1).parameters == 1e9
    for bad in (dict(stage=4), dict(stage=2, offload_param=True),
                dict(stage=2, hpz_partition_size=4), dict(stage=3, hpz_partition_size=32)):
        with pytest.raises(ValueError):
            estimate(8e9, 16, **bad)


def test_estimate_is_the_sum_of_estimate_by_location():
    """One estimator: every Estimate field is a sum over estimate_by_location's locations."""
    from minizero.memory import estimate_by_location
    for stage in (0, 1, 2, 3):
        for off in ((False, False), (True, False), (True, True)):
            if stage == 0 and off[0] or stage != 3 and off[1]:
                continue
            e = estimate(7e9, 4, stage, offload_optimizer=off[0], offload_param=off[1])
            b = estimate_by_location(7e9, 4, stage, 2, 2, 8, "cpu" if off[0] else "none",
                                     "cpu" if off[1] else "none")
            assert e.by_location == b
            assert e.device == sum(v["device"] for v in b.values())
            assert e.host == sum(v["host"] for v in b.values())
            assert e.total == e.device + e.host + e.disk
    # the check: ZeRO-2 + offload on one GPU keeps 2 bytes per parameter on the device (16 / 2 = 8x)
    psi = 13e9
    b = estimate_by_location(psi, 1, 2, param_bytes=2, grad_bytes=2, offload_optimizer="cpu")
    assert sum(v["device"] for v in b.values()) == 2 * psi == b["parameters"]["device"]
    assert estimate(psi).device / sum(v["device"] for v in b.values()) == 8


def test_inference_bytes_7b():
    got = [inference_bytes(7e9, d) / 1e9 for d in ("fp32", "fp16", "bf16", "int8", "int4")]
    assert got == [28, 14, 14, 7, 3.5]
    with pytest.raises(ValueError):
        inference_bytes(7e9, "fp8")


def test_activation_bytes_by_hand():
    # s=2, b=1, h=4, a=2: s*b*h = 8, a*s*s*b = 8 -> 8*34 + 8*5 = 312 bytes per layer.
    assert activation_bytes(1, 2, 4, layers=1, heads=2) == 312
    assert activation_bytes(1, 2, 4, layers=3, heads=2) == 3 * 312
    # Full checkpointing keeps only each layer's 16-bit input: 2*s*b*h.
    assert activation_bytes(1, 2, 4, layers=3, heads=2, checkpointing=True) == 3 * 16
    # fp32 activations, dropout masks stay 1 byte: 8*(16*4+2) + 8*(2*4+1).
    assert activation_bytes(1, 2, 4, layers=1, heads=2, bytes_per=4) == 528 + 72


def test_activation_bytes_with_tensor_and_sequence_parallelism_by_hand():
    # Korthikanti et al.: TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh/t (34 + 5as/h); s=2, b=1, h=4, a=2, t=2
    assert activation_bytes(1, 2, 4, layers=1, heads=2, tensor_parallel=2) == 8 * (10 + 12 + 2.5)
    assert activation_bytes(1, 2, 4, layers=1, heads=2, tensor_parallel=2, sequence_parallel=True) == 8 / 2 * (34 + 5)
    # without dropout, fp32: w(4sbh) whole + w(12sbh + as^2b)/t
    assert activation_bytes(1, 2, 4, layers=1, heads=2, bytes_per=4, tensor_parallel=2, dropout=False) == \
        4 * 4 * 8 + 4 * (12 * 8 + 8) / 2
    assert activation_bytes(1, 2, 4, layers=2, heads=2, checkpointing=True, tensor_parallel=2, sequence_parallel=True) \
        == 2 * 2 * 8 / 2


# --------------------------------------------------------------------- ledger

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, 7)  # odd width
        self.fc2 = nn.Linear(7, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((5,), 0.5))

    def forward(self, idx):
        x = self.emb(idx) * self.scale.mean()
        return self.head(self.fc2(torch.relu(self.fc1(x))))


def _train(model, steps=2):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    idx = torch.arange(8).remainder(11).view(2, 4).to(next(model.parameters()).device)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
    return opt


def test_ledger_of_replicated_model_matches_hand_count():
    torch.manual_seed(0)
    model = Tiny()
    opt = _train(model)
    unique = {id(p): p for p in model.parameters()}.values()
    param_bytes = sum(p.numel() * p.element_size() for p in unique)
    assert param_bytes == (66 + 42 + 7 + 42 + 6) * 4  # emb(=head), fc1, fc2 in fp32
    adam_bytes = sum(2 * p.numel() * p.element_size() + 4 for p in unique)  # m, v, fp32 step

    ledger = measure(model, opt)
    assert ledger.by_category == {"parameters": param_bytes, "master_params": 0,
                                  "gradients": param_bytes, "optimizer_state": adam_bytes,
                                  "buffers": 5 * 4}
    assert ledger.by_location == {"device": ledger.total, "host": 0, "disk": 0}
    assert ledger.total == 2 * param_bytes + adam_bytes + 20
    # The tied weight is reachable twice; a naive sum would count it twice.
    naive = sum(p.numel() * 4 for _, p in model.named_parameters(remove_duplicate=False))
    assert naive == param_bytes + 66 * 4 != ledger.by_category["parameters"]
    # Against the estimator (fp32 Adam: 4 + 4 + 8 bytes/param), exact but for Adam's steps.
    psi = param_bytes // 4
    e = estimate(psi, k=8, param_bytes=4, grad_bytes=4)
    assert (e.parameters, e.gradients) == (ledger.by_category["parameters"],
                                           ledger.by_category["gradients"])
    assert ledger.by_category["optimizer_state"] - e.optimizer_state == 5 * 4  # 5 step counters
    assert ledger.cuda_max_allocated is None and ledger.cuda_allocated is None
    json.dumps(ledger.as_dict())
    assert "optimizer_state" in str(ledger) and f"{ledger.total / 1e6:.3f}" in str(ledger)


def test_cpu_tensors_are_host_when_computing_on_cuda():
    model = Tiny()
    ledger = measure(model, device="cuda")  # no CUDA needed: only classifies
    assert ledger.by_location["host"] == ledger.total == (66 + 42 + 7 + 42 + 6 + 5) * 4


def test_views_into_a_flat_buffer_count_the_buffer_once():
    flat = torch.zeros(101)
    lin = nn.Linear(5, 3)  # 15 + 3 = 18 of the 101 elements
    lin.weight.data = flat[:15].view(3, 5)
    lin.bias.data = flat[15:18]
    assert measure(lin).by_category["parameters"] == 101 * 4
    # A zero-size (freed) storage holds nothing.
    flat.untyped_storage().resize_(0)
    assert measure(lin).total == 0


class Sharded:
    """Speaks the memory_tensors() protocol, like the sharded wrappers do."""

    def __init__(self):
        self.flat = torch.zeros(64, dtype=torch.float16)   # 128 B: params AND grads
        self.master = torch.zeros(16)                       # 64 B on the host
        self.exp_avg = torch.zeros(16)                      # 64 B

    def memory_tensors(self):
        yield "gradients", self.flat[32:], None             # claimed first, loses precedence
        yield "parameters", self.flat[:32], None
        yield "master_params", self.master, "host"
        yield "optimizer_state", self.exp_avg, None
        yield "optimizer_state", 1000, "disk"               # e.g. exp_avg_sq in a file


def test_memory_tensors_protocol_precedence_locations_and_disk():
    ledger = measure(Sharded())
    assert ledger.by_category == {"parameters": 128, "master_params": 64, "gradients": 0,
                                  "optimizer_state": 64 + 1000, "buffers": 0}
    assert ledger.by_location == {"device": 128 + 64, "host": 64, "disk": 1000}
    assert ledger.detail["optimizer_state"] == {"device": 64, "host": 0, "disk": 1000}


def test_measure_rejects_bad_input():
    class Bad:
        def __init__(self, entry):
            self.entry = entry

        def memory_tensors(self):
            yield self.entry
    for entry in [("weights", 8, "disk"), ("buffers", 8, "gpu"), ("buffers", 8, None)]:
        with pytest.raises(ValueError):
            measure(Bad(entry))
    with pytest.raises(TypeError):
        measure(object())


def test_transient_high_water_mark():
    transient.alloc("a", 100)
    transient.alloc("b", torch.zeros(50, dtype=torch.uint8))
    assert (transient.current, transient.peak) == (150, 150)
    transient.free("a")
    transient.alloc("c", 120)
    assert (transient.current, transient.peak) == (170, 170)
    with transient.hold("d", torch.zeros(10)):  # 40 B
        assert transient.current == 210
    assert (transient.current, transient.peak) == (170, 210)
    # A view counts its whole storage, like the ledger does.
    transient.alloc("b", torch.zeros(1000, dtype=torch.uint8)[:1])
    assert (transient.current, transient.peak) == (1120, 1120)
    assert measure(nn.Linear(1, 1)).transient_peak == 1120
    with pytest.raises(KeyError):
        transient.free("nope")
    transient.reset()
    assert (transient.current, transient.peak) == (0, 0)
    assert Ledger().total == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ledger_records_max_allocated():
    model = Tiny().cuda()
    opt = _train(model, steps=1)
    ledger = measure(model, opt)
    assert ledger.by_location["device"] >= 2 * (66 + 42 + 7 + 42 + 6) * 4
    assert ledger.cuda_max_allocated >= ledger.cuda_allocated >= ledger.by_location["device"]


def test_saved_tensors_meter_counts_what_autograd_keeps_until_it_frees_it():
    import gc

    from minizero.models import GPTConfig, TinyGPT
    block = TinyGPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)).h[0]
    meter = memory.SavedTensors(exclude=block.parameters())
    x1, x2 = (torch.randn(2, 16, 32, requires_grad=True) for _ in range(2))
    with meter.hooks():
        y1 = block(x1)
    one = meter.live
    assert one >= x1.numel() * 4 and meter.peak == one  # at least the block's input, saved by ln_1
    with meter.hooks():
        y2 = block(x2)
        y3 = block(x2)  # the same input saved by a third graph: its storage is counted once
    assert 2 * one < meter.live < 3 * one
    y1.sum().backward()  # a backward frees its graph's saved tensors
    y3.sum().backward()
    assert meter.live == one
    del y2
    gc.collect()
    assert meter.live == 0  # dropping a graph frees it too: no reference cycle left behind
    w = block.attn.c_attn.weight
    assert (str(w.device), w.untyped_storage().data_ptr()) in meter.excluded  # parameters are not activations
