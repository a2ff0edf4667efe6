"""ZeRO++ (minizero/zero/zeropp.py) on simulated nodes, and the intra/cross-node byte accounting.

One 4-rank job (2 nodes x 2) runs everything of tests/zeropp_workers.py:main, odd sizes and node
counts on 3 of its ranks. Expected bytes come from the ring model written out by hand, or from
experiments.zeropp.formula (derived from the padded unit sizes, never from comm.stats).
Tolerances: hpZ (and ZeroPP with everything off) must equal FSDP bitwise: they move the same
values. qwZ's loss equals a plain model whose weights were quantized by hand, to 1e-6 (only the
order of float additions may differ). qgZ's gradients are int4 twice over: relative L2 error
under 0.25 (a block's step is max|g|/7, so elements near the block maximum are off by up to 7%,
small ones by up to their whole size), and nonzero: it really is quantized."""
import re
from types import SimpleNamespace

import pytest
import torch

import minizero
from minizero import launch
from minizero_course.experiments.zeropp import VARIANTS, formula, measured_per_node
from minizero.models import build_model
from minizero.runtime.config import ConfigError, load_config
from minizero.zero.zeropp import ZeroPP

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/zeropp_workers.py:"
_cache = {}


def main_results(tmp_path_factory):
    if "main" not in _cache:
        ckpt = tmp_path_factory.mktemp("zeropp_ckpt")
        _cache["main"] = launch.run(W + "main", nprocs=4, args={"ckpt_dir": str(ckpt)}, timeout=600)
    return _cache["main"]


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return main_results(tmp_path_factory)


# ---------------------------------------------------------------------------- byte accounting
# 4 ranks, nodes [0, 0, 1, 1]; ring order 0 -> 1 -> 2 -> 3 -> 0, so ranks 1 and 3 send off-node.
# {op: [sent, cross]} per rank, worked out by hand from the payloads in stats_split:
#   all_gather 400 B / 4 ranks: 3/4 * 400 = 300 to the ring successor
#   all_to_all 400 B / 4 ranks: 100 to each other rank, 2 of them on the other node: 200 cross
#   node all_reduce 160 B / 2 ranks: 2 * 1/2 * 160 = 160, inside the node
#   cross_node reduce_scatter 80 B / 2 ranks: 40, to the other node
#   broadcast 40 B on world ranks [0, 2] (nodes 0, 1): 20, cross; ranks 1 and 3 are not in it
#   send 20 B to rank r+1: cross from ranks 1 and 3
HAND = {0: {"all_gather": [300, 0], "all_to_all": [300, 200], "all_reduce": [160, 0], "reduce_scatter": [40, 40],
            "broadcast": [20, 20], "send": [20, 0], "recv": [0, 0]},
        1: {"all_gather": [300, 300], "all_to_all": [300, 200], "all_reduce": [160, 0], "reduce_scatter": [40, 40],
            "send": [20, 20], "recv": [0, 0]},
        2: {"all_gather": [300, 0], "all_to_all": [300, 200], "all_reduce": [160, 0], "reduce_scatter": [40, 40],
            "broadcast": [20, 20], "send": [20, 0], "recv": [0, 0]},
        3: {"all_gather": [300, 300], "all_to_all": [300, 200], "all_reduce": [160, 0], "reduce_scatter": [40, 40],
            "send": [20, 20], "recv": [0, 0]}}


def test_ring_split_by_hand(res):
    for rank, r in enumerate(res):
        s = r["stats"]
        assert s["world"] == HAND[rank], f"rank {rank}"
        assert s["total_cross"] == sum(c for _, c in HAND[rank].values())
        assert s["total_intra"] == sum(a - c for a, c in HAND[rank].values())
        # each group books its own ops, and they also count into the world's
        assert s["groups"] == {"node": 0.0, "cross_node": 40.0, "node_sent": 160.0}


# (the same accounting on the torch backend: tests/test_mesh.py checks a group's cross-node bytes on both)


# ---------------------------------------------------------------------------- traffic vs formula
def _per_node(per_rank, key="traffic"):
    t = [r[key] for r in per_rank]
    return t, t[0]["N"], t[0]["k"], t[0]["padded"]


def test_cross_node_bytes_equal_the_ring_formula_for_every_variant(res):
    t, N, k, padded = _per_node(res)
    for name in VARIANTS:
        nodes = measured_per_node(t, name, k)
        want = formula(name, padded, N, k, elem_bytes=2)
        for node in nodes:
            for coll, (intra, cross) in want.items():
                assert node[coll] == pytest.approx([intra, cross], abs=1e-6), (name, coll)


def test_persistent_parameters_and_a_unit_with_nothing_sharded_keep_the_formula_exact(res):
    """A threshold that keeps the root unit whole (nothing of it gathered or kept by hpZ) and part of each
    block: every variant trains, and its bytes are the formula's with 2(N-1)/N of the persistent elements
    all-reduced per rank."""
    t, N, k, padded = _per_node(res, "traffic_persistent")
    persistent = t[0]["persistent"]
    assert 0 in padded and any(padded), padded   # a unit with no sharded part, and units with one
    assert persistent > 0
    for name in VARIANTS:
        nodes = measured_per_node(t, name, k)
        want = formula(name, padded, N, k, elem_bytes=2, persistent_numel=persistent)
        without = formula(name, padded, N, k, elem_bytes=2)
        assert want["gradients"] != without["gradients"]  # the persistent all-reduce is in the formula
        for node in nodes:
            for coll, (intra, cross) in want.items():
                assert node[coll] == pytest.approx([intra, cross], abs=1e-6), (name, coll)
        assert all(r["variants"][name]["loss"] == r["variants"][name]["loss"] for r in t)  # finite: not NaN


def test_fp16_table_reproduces_3M_to_075M_up_to_scales_and_padding(res):
    """Normalized like the paper (per collective, dropping the ring's (n-1)/n): 3M -> 0.75M."""
    t, N, k, padded = _per_node(res)
    M = 2 * sum(padded)
    ring, a2a = (N - 1) / N, (N // k - 1) / (N // k)
    paper = {}
    for name in VARIANTS:
        node = measured_per_node(t, name, k)[0]
        grad_factor = a2a if VARIANTS[name] and VARIANTS[name]["quantized_gradients"] else ring
        paper[name] = (node["forward_all_gather"][1] / ring + node["backward_all_gather"][1] / ring
                       + node["gradients"][1] / grad_factor) / M
    scale_bytes = 4 / 2048 * 2 + 4 / 512  # per element, at most: one fp32 scale per block (+1 block per shard)
    assert paper["ZeRO-3"] == pytest.approx(3.0, abs=1e-9)
    assert paper["+hpZ"] == pytest.approx(2.0, abs=1e-9)
    for name, want in (("+qwZ", 2.0), ("+qgZ", 2.25), ("ZeRO++", 0.75)):
        assert want < paper[name] < want + 0.02, (name, paper[name], scale_bytes)


def test_hpz_costs_one_node_share_of_the_parameters(res):
    t = res[0]["traffic_fp32"]
    extra = t["variants"]["+hpZ"]["ledger"]["parameters"] - t["variants"]["ZeRO-3"]["ledger"]["parameters"]
    assert extra == 4 * sum(t["padded"]) // t["k"]


def test_odd_sizes_and_node_counts(res):
    """3 ranks as 3 nodes of 1 and as 1 node of 3, the 209-element edge model (padding to 210, int4 rows
    of odd length, a tied, a frozen and an unused parameter): bytes equal the formula, losses finite and
    within 2% of ZeRO-3's. (6 ranks as 3 nodes x 2 and 2 x 3 were measured equal to the formula too,
    when this was written; a 6-rank job is too slow for the suite on 2 cores.)"""
    per_rank = [r["odd"] for r in res[:3]]
    assert res[3]["odd"] is None
    for k in ("1", "3"):
        t = [r[k] for r in per_rank]
        N, padded = t[0]["N"], t[0]["padded"]
        assert N == 3 and padded == [210]
        for name in VARIANTS:
            for node in measured_per_node(t, name, int(k)):
                for coll, pair in formula(name, padded, N, int(k), elem_bytes=4).items():
                    assert node[coll] == pytest.approx(pair, abs=1e-6), (k, name, coll)
            loss, base = t[0]["variants"][name]["loss"], t[0]["variants"]["ZeRO-3"]["loss"]
            assert torch.isfinite(torch.tensor(loss)) and abs(loss - base) < 0.02 * base, (k, name, loss, base)
        cross = sum(c for _, c in measured_per_node(t, "ZeRO++", int(k))[0].values())
        assert (cross > 0) == (k == "1")  # 3 nodes: traffic crosses; 1 node: none does


# ---------------------------------------------------------------------------- correctness
def test_hpz_and_everything_off_equal_fsdp_bitwise(res):
    for r in res:
        a = r["against_fsdp"]
        for name in ("off", "hpz"):
            assert a[name]["losses_equal"] and a[name]["params_bitwise"], (name, a[name])
        for name in ("qwz", "qgz"):  # quantized: close, not equal
            assert not a[name]["params_bitwise"] and a[name]["max_param_diff"] < 0.05, (name, a[name])


def test_qwz_computes_with_the_block_quantized_shards(res):
    for r in res:
        q = r["qwz"]
        assert q["over_bound"] <= 1e-7  # the hand-quantized weights are within scale/2 ...
        assert q["loss"] == pytest.approx(q["by_hand"], rel=1e-6, abs=1e-6)  # ... and qwZ computes with them
        rel, worst = q["weight_error"]
        assert 0 < rel < 0.01 and worst > 0


def test_qgz_gradient_error_is_bounded_and_real(res):
    for r in res:
        rel, worst = r["qgz_error"]
        assert 0 < rel < 0.25, rel


def test_short_convergence_within_1_1x_of_zero3(res):
    """30 steps (the bench runs 300): mean of the last 10 losses against ZeRO-3's, DeepSpeed's criterion."""
    conv = res[0]["convergence"]
    base = sum(conv["ZeRO-3"][-10:]) / 10
    assert conv["ZeRO-3"][-1] < conv["ZeRO-3"][0] - 0.3  # it does learn
    for name, losses in conv.items():
        mean = sum(losses[-10:]) / 10
        assert mean < 1.1 * base, (name, mean, base)


def test_resume_with_hpz_is_bitwise_and_rebuilds_the_secondary_partition(res):
    for r in res:
        s = r["resume"]
        assert s["wrapper"] == "ZeroPP" and s["hpz"] and s["node_size"] == 2
        assert s["resumed"] == s["straight"] and s["params_bitwise"]
        assert s["reloaded"] == s["straight"] and s["reloaded_bitwise"]


def test_node_size_one_warns_and_turns_hpz_off(res):
    w = res[0]["warn"]
    assert any("node_size=1" in m and "hpZ" in m and "no-op" in m for m in w["messages"]), w
    assert not w["hpz"] and w["secondary"] == 0


# ---------------------------------------------------------------------------- bad input
def _cfg(stage=3, **zero):
    return {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, **zero}}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("key, value", [("zero_quantized_weights", True), ("zero_quantized_gradients", True),
                                        ("zero_hpz_partition_size", 2)])
def test_zeropp_keys_need_stage_3(stage, key, value):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key} is ZeRO\\+\\+, which needs stage 3"):
        load_config(_cfg(stage, **{key: value}), world_size=4)


@pytest.mark.parametrize("size, words", [(3, "zero_hpz_partition_size=3 does not divide the world size 4"),
                                         (8, "zero_hpz_partition_size=8 does not divide the world size 4"),
                                         (0, "must be at least 1, got 0"), ("2", "must be an integer, got '2'")])
def test_hpz_size_must_tile_the_world(size, words):
    with pytest.raises(ConfigError, match=words):
        load_config(_cfg(zero_hpz_partition_size=size), world_size=4)


@pytest.mark.parametrize("other, words", [
    ({"tensor_parallel": {"autotp_size": 2}}, "(ZeRO++) with tensor_parallel.autotp_size=2 is not implemented"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "(ZeRO++) with offload_optimizer is not impl"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "(ZeRO++) with offload_param is not implemented")])
def test_zeropp_with_tp_or_offload_is_refused(other, words):
    cfg = _cfg(zero_quantized_gradients=True)
    for section, keys in other.items():
        cfg[section] = {**cfg.get(section, {}), **keys}
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(cfg, world_size=4)


def test_valid_zeropp_config_and_mesh_mismatch_fail_before_any_collective():
    cfg = load_config(_cfg(zero_quantized_weights=True, zero_hpz_partition_size=2, zero_quantized_gradients=True), 4)
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 2
    with pytest.raises(ConfigError, match=r"must be a boolean \(true or false\), got 'yes'"):
        load_config(_cfg(zero_quantized_weights="yes"), 4)
    mesh = SimpleNamespace(world=SimpleNamespace(size=4), node_size=4)  # no collective can run on this
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=2 but the mesh has nodes of 4 ranks"):
        minizero.initialize(model=build_model("tiny-gpt"), config=_cfg(zero_hpz_partition_size=2), mesh=mesh)


def test_hpz_must_match_the_launchers_nodes(monkeypatch):
    """On real nodes (the launcher's local size below the world), hpZ's partition is a node: a ConfigError
    from the environment alone, before any communicator exists."""
    from minizero.runtime.resolve import resolve
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=4 but the launcher put 2 ranks on each node"):
        resolve(_cfg(zero_hpz_partition_size=4), 4, build_model("tiny-gpt"))
    assert resolve(_cfg(zero_hpz_partition_size=2), 4, build_model("tiny-gpt")).config[
        "zero_optimization"]["zero_hpz_partition_size"] == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one machine: hpZ simulates its nodes, as lesson 08 does
    assert resolve(_cfg(zero_hpz_partition_size=2), 4, build_model("tiny-gpt")).config[
        "zero_optimization"]["zero_hpz_partition_size"] == 2


@pytest.mark.parametrize("kw", [dict(weight_block_numel=0), dict(grad_block_numel=-8), dict(weight_block_numel=1.5)])
def test_block_size_must_be_positive_before_any_collective(kw):
    mesh = SimpleNamespace(world=None, pp_size=1, tp_size=1, node_size=2)  # never reached
    with pytest.raises(ValueError, match="block_numel must be a positive int"):
        ZeroPP(build_model("tiny-gpt"), mesh, **kw)


def test_zeropp_needs_a_pure_data_parallel_mesh():
    mesh = SimpleNamespace(world=SimpleNamespace(size=4), pp_size=2, tp_size=1, node_size=2)
    with pytest.raises(ValueError, match="build it with pp=1 and tp=1"):
        ZeroPP(build_model("tiny-gpt"), mesh)


# ---------------------------------------------------------------------------- the planner against these runs
@pytest.mark.parametrize("key, dtype", [("traffic", "fp16"), ("traffic_fp32", "fp32")])
def test_the_planner_predicts_each_variants_bytes_and_hpz_memory(res, key, dtype):
    """minizero/planner never sees a measurement: its bytes per rank per step (from zeropp.bytes_per_rank
    on the units it derives from the shape) equal comm.stats of every rank and variant exactly, the
    cross-node share included; its parameter bytes (fp32 shards and hpZ's partition) equal the ledger's up
    to the shards' padding."""
    from minizero_course.experiments.zeropp import LESSON_GPT
    from minizero.models import GPTConfig
    from minizero.planner import ModelShape, ParallelStrategy, plan
    g = GPTConfig(**LESSON_GPT)
    shape = ModelShape(g.n_layer, g.n_embd, g.n_head, g.block_size, g.vocab_size, g.tie_weights)
    t = [r[key] for r in res]
    N, k = t[0]["N"], t[0]["k"]
    for name in t[0]["variants"]:
        flags = VARIANTS[name] or {}
        strategy = ParallelStrategy(N, node_size=k, zero=3, micro_batch=2, precision=dtype, optimizer="sgd",
                            qwz=flags.get("quantized_weights", False), hpz=flags.get("hpz", False),
                            qgz=flags.get("quantized_gradients", False))
        stage = plan(shape, strategy).stages[0]
        for rank, r in enumerate(t):
            v = r["variants"][name]
            sent = sum(a + c for phase in ("forward", "backward") for a, c in v[phase].values())
            cross = sum(c for phase in ("forward", "backward") for _, c in v[phase].values())
            assert sent == pytest.approx(sum(stage.sent.values()), abs=1e-6), (name, rank, stage.sent)
            if flags.get("quantized_gradients"):  # qgZ's second hop is the only traffic meant to cross
                assert stage.sent["dp-across"] <= cross, (name, rank)
            # the bytes holding the parameters: the fp32 shards (booked as master_params when the compute
            # dtype is 16-bit) plus hpZ's secondary partition, up to the shards' padding
            held = v["ledger"]["parameters"] + v["ledger"]["master_params"]
            planned = stage.memory["parameters"] + stage.memory["master_params"]
            padding = (g.n_layer + 1) * (N - 1) * 4
            assert 0 <= held - planned <= padding, (name, rank, v["ledger"], stage.memory)
