"""DeepSpeed's engine semantics where a DeepSpeed program relies on them (tests/semantics_workers.py, ONE 2-rank
job): a client optimizer next to an 'optimizer' section, several backward calls before one step, two engines
whose graphs cross (DeepSpeedExamples' DCGAN), at ZeRO stages 0-3 and with the optimizer offloaded.

Tolerance 1e-6: fp32, the same arithmetic in another summation order (an Adam step of lr 1e-2 moves the weights
by about 2e-2, so an error of the size of one step's change would show).
"""
import pytest

from minizero import launch

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

_job = []
WHERE = ["0/none", "1/none", "2/none", "3/none", "1/cpu", "2/cpu", "3/cpu"]  # ZeRO stage / offload_optimizer


@pytest.fixture(scope="module")
def res():
    if not _job:
        _job.append(launch.run("tests/semantics_workers.py:run_all", nprocs=2, timeout=600))
    return _job[0]


def test_client_optimizer_and_scheduler_override_the_config_sections_with_a_warning(res):
    for rank, out in enumerate(r["client_optimizer"] for r in res):
        assert out["class"] == "SGD" and out["lr"] == 0.125 and out["scheduler"] == "StepLR"
        # rank 0 says it once for the job (the config's other keys are read as usual)
        assert len(out["warnings"]) == (2 if rank == 0 else 0), out["warnings"]
        if rank == 0:
            assert "optimizer=SGD) overrides the config's 'optimizer' section (Adam)" in out["warnings"][0]
            assert "'scheduler' section (WarmupLR)" in out["warnings"][1]


@pytest.mark.parametrize("where", WHERE)
def test_several_backwards_before_one_step_add_up(res, where):
    for rank, out in enumerate(r["several_backwards"][where] for r in res):
        assert out["moved"] > 1e-2, (rank, out)  # two Adam steps moved the weights
        assert out["two_vs_summed"] <= 1e-6, (rank, out)
        assert out["two_vs_torch"] <= 1e-6, (rank, out)


@pytest.mark.parametrize("where", WHERE)
def test_gan_generator_backward_through_the_discriminator_engine_trains_as_torch(res, where):
    for rank, out in enumerate(r["gan"][where] for r in res):
        assert "error" not in out, out.get("error")
        assert out["g_moved"] > 1e-2, (rank, out)
        assert out["d_vs_torch"] <= 1e-6, (rank, out)  # G's backward left nothing in D's next step
        assert out["g_vs_torch"] <= 1e-6, (rank, out)


def test_pipeline_module_num_stages_training_data_train_batch_eval_batch_and_accessors(res):
    for rank, out in enumerate(r["pipeline"] for r in res):
        # num_stages came from the PipelineModule (the config has no pipeline section); rank r holds stage r
        assert out["accessors"] == ["PipelineEngine", 2, rank, rank == 0, rank == 1, 4, rank, True]
        for mine, reference in zip(out["losses"], out["torch"]):  # train_batch() read training_data in order
            assert abs(mine - reference) <= 1e-6, (rank, out["losses"], out["torch"])
        assert abs(out["eval"] - out["torch_eval"]) <= 1e-6, (rank, out["eval"], out["torch_eval"])
        # the training iterator went on where it was: its 4th batch is rows 24-31, the ones eval_batch was given
        assert abs(out["training_after_eval"] - out["eval"]) <= 1e-6
        assert "pipeline.stages = 1 but the PipelineModule was built with num_stages=2" in \
            out["errors"]["stages_differ"]
        assert "return_logits other than DeepSpeed's default is not implemented" in out["errors"]["eval_logits"]


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_master_weights_grads_and_optimizer_states_step_in_bf16_and_the_ledger_shows_the_bytes(res, stage):
    for rank, out in enumerate(r["bf16_masters"][str(stage)] for r in res):
        # torch stepping the bf16 model itself; one bf16 step of slack for the reduction's order (0 seen)
        assert out["vs_torch_ulps"] <= 1.0, (rank, out)
        assert out["vs_fp32_masters"] > 0  # the fp32-master run rounds differently: the keys changed the step
        assert out["state_dtypes"] == ["torch.bfloat16"] and out["fp32_state_dtypes"] == ["torch.float32"]
        s = out["shard_numel"]
        # no fp32 master shard (4 bytes each; the bf16 shard is the master) and Adam's 2 moments at 2 bytes, not 4
        assert out["saved"] == {"master_params": 4 * s, "optimizer_state": 2 * (4 - 2) * s, "gradients": 0,
                                "parameters": 0}, (rank, out["saved"], s)


def test_bf16_and_fp16_master_keys_refused_where_deepspeed_refuses_or_minizero_does_not_implement(res):
    errors = res[0]["bf16_masters"]["errors"]
    assert "needs ZeRO stage 1, 2 or 3 (as in DeepSpeed), got stage 0" in errors["stage0"]
    assert "at ZeRO stage 3 is not implemented by minizero" in errors["stage3"]
    assert "bf16_optimizer_states': true needs bf16.bf16_master_weights_and_grads true" in errors["states_alone"]
    assert "implemented with bf16.bf16_optimizer_states true and offload_optimizer device none" in \
        errors["masters_alone"]
    assert "'fp16.fp16_master_weights_and_grads': true is not implemented" in errors["fp16_masters"]
    assert "ZeRO-Offload and DeepSpeedCPUAdam" in errors["fp16_masters"]
