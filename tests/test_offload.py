"""Offload (zero/offload.py, zero/infinity.py) and zero.Init (zero/init.py), measured.

One 2-rank launch (tests/offload_workers.py) trains the engine with and without offload. Tolerances:
  * SGD: offload == no offload BITWISE at stages 1-3, and the disk tier == the cpu tier bitwise
    (torch's fused CPU SGD runs the same float operations as the default loop).
  * Adam(W): the fused CPU kernel rounds differently from the default loop (measured 9e-10 after
    3 steps on 5M elements); within lr/10 as everywhere Adam is compared.
Bytes moved come from HostOptimizer.traffic (counted where copied), memory from the ledger; the
expected values from the layout and memory.estimate_by_location, never from the measured numbers.
"""
import pytest
import torch

from minizero import launch, memory
from minizero.models import build_model
from minizero.runtime.config import ConfigError, load_config
from minizero.zero.infinity import DiskError, check_nvme_path
from minizero.zero.init import Init, built_with_init

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

N = 2
_job = []
_job4 = []


def results():
    if not _job:
        _job.append(launch.run("tests/offload_workers.py:job", nprocs=N, timeout=420))
    return _job[0]


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_offload_trains_like_no_offload(stage):
    for rank, r in enumerate(results()):
        assert r[f"{stage}/sgd"]["bitwise"], (f"stage {stage} rank {rank}: SGD differs by "
                                              f"{r[f'{stage}/sgd']['max_abs']:.3g}")
        if f"{stage}/adam" in r:  # one stage is enough for the fused kernel's rounding
            assert r[f"{stage}/adam"]["max_abs"] <= 1e-3, f"stage {stage}: Adam {r[f'{stage}/adam']['max_abs']:.3g}"


def fp16_runs():
    """{world size: that launch's per-rank fp16 layouts}: 2 ranks from the main job, 4 from a launch of its own."""
    if not _job4:
        _job4.append(launch.run("tests/offload_workers.py:layouts_job", nprocs=4, timeout=300))
    return {N: [r["fp16"] for r in results()], 4: _job4[0]}


def test_pcie_traffic_is_2_psi_over_n_each_way_in_fp16():
    """ZeRO-Offload (Ren et al. 2021, Sec. 3.3, 4.2): 2Ψ/N of 16-bit gradients down and 2Ψ/N of 16-bit parameters
    up per step and rank (Ψ padded to N shards). Stage 2 sends each micro-batch's reduced shard during its
    backward, so down = micro-batches x 2Ψ/N; stage 3 sends the fp32 reduce-scatter output (4 bytes: FSDP
    casts it on the device before it leaves, zero/fsdp.py _reduce_shard_grad)."""
    for world, ranks in fp16_runs().items():
        for r in ranks:
            for stage, grad_width in ((2, 2), (3, 4)):
                run = r[str(stage)]  # the launch returns JSON: string keys
                shard = run["shard_numel"]
                assert run["skipped"] == 0 and run["device_dtypes"] == ["torch.float16"], (world, stage, run)
                assert run["traffic"]["to_host"] == run["micro_batches"] * grad_width * shard, (world, stage, run)
                assert run["traffic"]["to_device"] == 2 * shard, (world, stage, run)
    for stage in (1, 2):  # fp32: 4 + 4 bytes per element of the shard; stage 1 reduces once, at the step
        t, s = results()[0][f"{stage}/traffic"], results()[0][f"{stage}/shard_numel"]
        assert (t["to_host"], t["to_device"]) == (4 * s * (1 if stage == 1 else 2), 4 * s)
    t, s = results()[0]["3/traffic"], results()[0]["3/shard_numel"]
    assert (t["to_host"], t["to_device"]) == (4 * s * 2, 4 * s), "ZeRO-3: each of the 2 micro-batches moves its grads"


def _expect(detail, want):
    for cat, locs in want.items():
        for loc, v in locs.items():
            assert detail[cat][loc] == v, f"{cat} on {loc}: ledger {detail[cat][loc]}, estimator {v}"


def test_ledger_by_location_equals_the_estimator():
    """The issue's check: a real ZeRO-2 + offload and ZeRO-3 + offload run (fp16, 2 and 4 ranks) holds, to the
    byte, what memory.estimate_by_location says, device and host: only the 16-bit parameters on the device
    (stage 2: all of them, stage 3: the shard), the fp32 master, gradients and momentum on the host."""
    for world, ranks in fp16_runs().items():
        for r in ranks:
            for stage in (2, 3):
                run = r[str(stage)]  # the launch returns JSON: string keys
                shard = run["shard_numel"]  # per rank; N shards = the padded Ψ (per unit at stage 3)
                want = memory.estimate_by_location(shard * world, world, stage, param_bytes=2, grad_bytes=2,
                                                   state_bytes=4, offload_optimizer="cpu")
                _expect(run["ledger"], want)
                device = sum(run["ledger"][c]["device"] for c in memory.STATE_CATEGORIES)
                assert device == 2 * shard * (world if stage == 2 else 1), (world, stage, device)
    # ZeRO-3 + nvme: masters and momentum on disk (the files' sizes), fp32 shards on the device
    r = results()[0]
    s = r["nvme/shard_numel"]
    want = memory.estimate_by_location(s * N, N, 3, param_bytes=4, state_bytes=4, offload_optimizer="nvme")
    _expect(r["nvme/ledger"], want)


def test_disk_tier_equals_cpu_tier_and_counts_its_bytes():
    for r in results():
        assert r["nvme"]["bitwise"], r["nvme"]
        s = r["nvme/shard_numel"]
        t = r["nvme/traffic"]  # last step: every sub-group read (master + momentum) and written back
        assert t["disk_read"] == t["disk_written"] == 2 * 4 * s, t
        assert r["nvme/sub_groups"] == -(-s // 1000)
        small, large = r["nvme/transient_peak"]["500"], r["nvme/transient_peak"]["5000"]
        # host bytes holding sub-groups: one stepping, one prefetched, at most 2 being written back
        assert 0 < small <= 4 * 2 * 4 * 500 < large, f"sub_group_size 500 held {small} B, 5000 held {large} B"


def test_parameter_shards_in_files_train_the_same_and_are_counted():
    """offload_param nvme (with offload_optimizer nvme): each parameter shard is a mapped file that holds the
    values the run trains; the parameters equal the cpu tier's bitwise; the ledger puts them on disk, as the
    estimator does; per step the files take the updated shard (4 bytes per element, besides the master and
    momentum) and give out a shard for every all-gather (the bytes copied to the device)."""
    N = len(results())
    for r in results():
        assert r["nvme_param"]["bitwise"], r["nvme_param"]
        assert r["nvme_param/files_hold_the_values"]
        assert r["nvme_param/local_parts_in_files"]  # named_parameters() shows the values the files hold
        s = r["nvme_param/shard_numel"]
        want = memory.estimate_by_location(s * N, N, 3, param_bytes=4, state_bytes=4, offload_optimizer="nvme",
                                           offload_param="nvme")
        _expect(r["nvme_param/ledger"], want)
        t = r["nvme_param/traffic"]
        assert t["disk_written"] == (2 + 1) * 4 * s, t  # master + momentum, and the parameters
        assert t["disk_read"] - 2 * 4 * s == t["to_device"] > 0, t  # every gathered shard came out of a file


def test_disk_full_is_a_clear_error_and_the_checkpoint_is_untouched():
    r = results()[0]
    assert r["disk_full"].startswith("DiskError") and "disk is full" in r["disk_full"], r["disk_full"]
    assert r["disk_full/ckpt_intact"]


def test_dpu_equals_plain_steps_during_warmup_then_delays():
    d = results()[0]["dpu"]
    assert d["dpu"][:3] == d["plain"][:3], "the first steps (warm-up 2, and the step using their result) must match"
    assert d["dpu"][3:] != d["plain"][3:], "after the warm-up the update is one step late: the losses must differ"
    assert d["cpu_steps"] == 5


def test_dpu_with_fp16_overflow_drops_that_step():
    """Defined behaviour: an overflowing step's gradients are dropped (no CPU step for them), the
    update already in flight lands, and training goes on with the next step."""
    for r in results():
        o = r["dpu/overflow"]
        assert o["skipped"] >= 1 and o["cpu_steps"] == 5 - o["skipped"], o
        assert o["adam_steps"] == [float(o["cpu_steps"])], o
        assert o["finite"]


def test_zero_init_engine_equals_whole_build():
    assert all(r["init"]["bitwise"] for r in results())


@pytest.mark.parametrize("name", ("cpu", "nvme"))
def test_checkpoint_resumes_bitwise_and_loads_without_offload(name):
    for r in results():
        assert r[f"resume/{name}"] == {"losses": True, "state": True}, r[f"resume/{name}"]
        assert r[f"reshard/{name}"]


# ---------------------------------------------------------------------------- no ranks needed
@pytest.mark.parametrize("name, kw", [("tiny-gpt", dict(n_layer=2, tie_weights=True)), ("edge", {}), ("mlp", {})])
def test_zero_init_materializes_bitwise(name, kw):
    whole = build_model(name, seed=3, **kw).state_dict()
    with Init():
        lazy = build_model(name, seed=3, **kw)
    assert all(p.is_meta for p in lazy.parameters()), "zero.Init must not allocate the parameters"
    rec = built_with_init(lazy)
    for n, t in list(lazy.named_parameters()) + list(lazy.named_buffers()):
        assert torch.equal(rec.materialize(t), whole[n]), n


def test_zero_init_leaves_the_global_rng_alone_and_handles_default_init():
    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    after_ref = torch.rand(3)
    torch.manual_seed(5)
    with Init():
        lazy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    assert torch.equal(torch.rand(3), after_ref), "the build must advance the global RNG exactly as a whole build"
    rec = built_with_init(lazy)
    assert all(torch.equal(rec.materialize(a), b) for a, b in zip(lazy.parameters(), ref.parameters()))


@pytest.mark.parametrize("zero, message", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 1, "offload_param": {"device": "cpu"}}, "offload_param needs stage 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, "needs stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
     "'nvme' (ZeRO-Infinity) needs stage 3"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "nvme_path is not set"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "dpu_warmup_steps": -1}},
     "dpu_warmup_steps' must be at least 0"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "dpu_warmup_steps": 2}},
     "needs device 'cpu'"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "partial offload is not implemented"),
    ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, "must be none, cpu or nvme"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
     "needs offload_optimizer.device='nvme'"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "nvme"}},
     "offload_param.device is nvme but nvme_path is not set"),
])
def test_bad_offload_configs(zero, message):
    with pytest.raises(ConfigError) as e:
        load_config({"train_batch_size": 8, "zero_optimization": zero})
    assert message in str(e.value)


def test_nvme_path_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(DiskError, match="is not a writable directory"):
        check_nvme_path(str(blocker / "nvme"))
    assert check_nvme_path(str(tmp_path / "new" / "dir")).endswith("dir")


def test_no_host_tensor_reaches_a_collective():
    """MINIZERO_STRICT_HOST=1 marks the tiers' host tensors (minizero/host.py) and the communicator refuses one as
    NCCL refuses a CPU tensor on a GPU: every offload family through initialize (stages 1-3, cpu and nvme,
    optimizer and parameters, fp32/bf16/fp16, clipping on and off, accumulation, DPU, zero.Init) must train,
    and the marks must change no number (losses bitwise equal to the same run unmarked)."""
    strict = [r["strict"] for r in results()]
    assert len(strict[0]) == 15, sorted(strict[0])
    for rank, cases in enumerate(strict):
        bad = {name: v for name, v in cases.items() if v is not True}
        assert not bad, f"rank {rank}: " + "; ".join(f"{k}: {v}" for k, v in bad.items())
