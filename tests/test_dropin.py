"""A torch, nanoGPT or DeepSpeed user's idioms on minizero's wrappers (tests/dropin_workers.py, ONE 2-rank job).

Each idiom either does what it does under torch DDP / DeepSpeed, or fails at the point of misuse with a
message naming the fix. Tolerances: 1e-6 where only summation order differs (a norm of values ~1, fp32);
0 where the same arithmetic runs (no_sync vs require_backward_grad_sync, model.step vs model.optim.step).
"""
import pytest

from minizero import launch

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

_job = []


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    if not _job:
        _job.append(launch.run("tests/dropin_workers.py:run_all", nprocs=2,
                               args={"tmp_dir": str(tmp_path_factory.mktemp("ds"))}, timeout=300))
    return _job[0]


def test_ddp_require_backward_grad_sync_is_no_sync_and_step_before_finish_is_refused(res):
    for out in (r["ddp"] for r in res):
        assert out["attribute_vs_no_sync"] == 0.0
        for how in ("no_sync", "attribute"):
            assert "before model.finish_gradient_synchronization()" in out[f"{how}/step_before_finish"]
            norm, reference = out[f"{how}/norm"]
            assert abs(norm - reference) <= 1e-6 * reference and reference > 0.01  # it had something to clip
            assert abs(out[f"{how}/clipped_norm"] - 0.01) <= 1e-6


def test_zero2_inner_optimizer_steps_like_the_wrapper_and_schedulers_see_it(res):
    for out in (r["zero2"] for r in res):
        assert out["inner_vs_wrapper"] == 0.0
        for how in ("wrapper", "inner"):
            assert out[f"{how}/warnings"] == []  # torch's "lr_scheduler.step() before optimizer.step()"
            assert out[f"{how}/lr"] == pytest.approx(1e-2 / 4)
            assert "no gradient yet: call loss.backward() first" in out[f"{how}/before_backward"]


def test_fsdp_per_rank_seeds_optimizer_before_wrapping_empty_parts_and_clip(res):
    for rank, out in enumerate(r["fsdp"] for r in res):
        assert out["init_vs_rank0"] == 0.0, f"rank {rank} kept its own initialisation"
        assert out["groups_still_trained"], "an optimizer built before wrapping holds parameters FSDP dropped"
        # AdamW at lr 1e-2 turns a near-zero gradient's last-bit difference (FSDP reduces in other
        # chunks than DDP's buckets) into up to ~1e-3 of lr: bitwise under ATEN_CPU_CAPABILITY=default,
        # 3.5e-6 with AVX2. A wrong reduction or a skipped group moves parameters by about lr.
        assert out["trained_vs_ddp"] <= 1e-5, out["trained_vs_ddp"]
        assert out["none_grads"] == [], f"rank {rank}: .grad None after backward for {out['none_grads']}"
        fsdp_norm, ddp_norm = out["norms"]
        assert abs(fsdp_norm - ddp_norm) <= 1e-6 * ddp_norm
        assert out["require_backward_grad_sync"] is None  # accepted: ZeRO-3 reduces every backward anyway
    assert any(r["fsdp"]["empty_parts"] for r in res), "no rank holds a 0-element part: the check said nothing"


def test_zero1_alone_keeps_batchnorm_statistics_equal_with_module(res):
    for out in (r["zero1"] for r in res):
        assert out["module/spread"] == 0.0
        assert out["none/spread"] > 1e-3  # the control: without module= the ranks drift apart


def test_deepspeed_initialize_signature_tuple_loader_and_its_errors(res):
    seen = []
    for out in (r["initialize"] for r in res):
        assert out["tuple"] == ["Engine", True, True]
        assert out["loader_batch"] == 2
        seen.append(out["loader"])
        assert out["client"] == ["AdamW", 5e-3, 0.05, "StepLR"]
        errors = out["errors"]
        assert "DeepSpeed's keywords: initialize(model=model, config=cfg)" in errors["positional"]
        assert "a config came twice" in errors["two_configs"]
        assert "lr_scheduler= must be a callable" in errors["scheduler_object"]
        assert "engine, optimizer, _, _ = minizero.initialize(...)" in errors["engine_from_tuple"]
    assert sorted(seen[0] + seen[1]) == list(range(16)) and not set(seen[0]) & set(seen[1])  # dp shares


def test_offload_with_two_param_groups_trains_like_the_device_and_resumes_bitwise(res):
    for rank, out in enumerate(r["offload_groups"] for r in res):
        assert out["control"] > 1e-4, f"one group lands {out['control']}: the groups make no difference here"
        for stage in (1, 2, 3):
            assert out[f"{stage}/groups"] == 2
            assert out[f"{stage}/vs_device"] <= 1e-6, f"rank {rank} stage {stage}: {out[f'{stage}/vs_device']}"
            assert out[f"{stage}/resumed"] == 0.0, f"rank {rank} stage {stage}: resumed {out[f'{stage}/resumed']}"
            # torch's clip line after an offloaded backward: ZeRO-1/2's right norm, FSDP's error at the call
            plain, offloaded = out[f"{stage}/clip_plain"], out[f"{stage}/clip_offload"]
            if stage < 3:
                assert offloaded == pytest.approx(plain, rel=1e-6), (rank, stage, offloaded, plain)
            else:
                assert isinstance(offloaded, str) and "gradient_clipping" in offloaded, (rank, offloaded)


def test_torch_clip_line_reaches_the_averaged_gradient_and_zero1_state_consolidates(res):
    for rank, out in enumerate(r["sharded_grads"] for r in res):
        reference, reference_inf = out["reference_norm"], out["reference_inf"]  # torch's clip over DDP's grads
        assert reference > 0.1
        for how in ("zero1", "zero2", "zero3"):
            assert abs(out[f"{how}/foreach_norm"] - reference) <= 1e-6 * reference, (how, out[f"{how}/foreach_norm"])
            assert abs(out[f"{how}/inf_norm"] - reference_inf) <= 1e-6 * reference_inf, how
            assert "only the norm of the whole tensor (dim=None)" in out[f"{how}/norm_over_dim"]
            assert out[f"{how}/full_tensor_vs_ddp"] <= 1e-6, (how, out[f"{how}/full_tensor_vs_ddp"])  # shapes too
        assert out["zero1/sum"] is None and out["zero3/sum"] is None  # real values: this rank's local gradient / part
        assert "holds no values" in out["zero2/sum"] and "model.grad_shard" in out["zero2/sum"]
        # p.grad.div_(2) reached the reduced shard the step uses: its norm halved too
        assert abs(out["zero1/halved_norm"] - reference / 2) <= 1e-6 * reference
        assert abs(out["zero1/shard_norm"] - reference / 2) <= 1e-6 * reference
        for key in ("before_consolidate", "after_step"):
            assert "optimizer.consolidate_state_dict(to=0)" in out[key], (rank, key)
        assert out["resumed_vs_continued"] == 0.0, f"rank {rank}: {out['resumed_vs_continued']}"
        assert out["torch_adamw_vs_continued"] <= 1e-6, f"rank {rank}: {out['torch_adamw_vs_continued']}"
        assert out["moved"] > 1e-3  # the resumed step moved the weights: the comparison says something
        assert out["bf16/resumed_vs_continued"] == 0.0, f"rank {rank}: {out['bf16/resumed_vs_continued']}"
        assert out["bf16/control"] > 1e-3  # without the saved state the run differs: the state mattered
    assert res[0]["sharded_grads"]["numel"] == 2 * res[0]["sharded_grads"]["model_numel"]  # AdamW: 2 moments, all
    assert "consolidated to rank 0, this is rank 1" in res[1]["sharded_grads"]["other_rank"]
