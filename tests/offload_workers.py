"""What tests/test_offload.py runs through minizero.launch (never inside pytest): ONE 2-rank job.

Each case trains the engine with and without offload on the same TinyGPT and batches and returns
what it measured: final parameters, losses, the bytes HostOptimizer/DiskOptimizer counted, the
ledger by location, DPU's steps, checkpoints. Expected values are computed by the tests from the
layout and the formulas, never from these numbers."""
import os
import resource
import tempfile

import numpy as np
import torch

from minizero.data import SyntheticTokens, shard
from minizero.models import build_model
from minizero.runtime import checkpoint
from minizero.runtime.engine import build_engine
from minizero.zero import infinity
from minizero.zero.init import Init

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
ADAM = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
ACC = 2


def config(stage, opt=SGD, fp16=False, offload=None, param=None, **zero):
    z = {"stage": stage, "stage3_param_persistence_threshold": 100, **zero}
    if offload:
        z["offload_optimizer"] = offload
    if param:
        z["offload_param"] = {"device": param}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACC, "gradient_clipping": 0.0,
            "optimizer": opt, "zero_optimization": z,
            "fp16": {"enabled": fp16, "initial_scale_power": 8, "loss_scale_window": 3}}


def train(engine, steps, inf_at=None):
    data, comm, losses = SyntheticTokens(GPT["vocab_size"], GPT["block_size"]), engine.comm, []
    for _ in range(steps):
        engine.offload_traffic() and engine.offload.traffic.reset()
        for i in range(ACC):
            x, y = shard(data.batch(engine.global_steps * ACC + i, 2 * comm.size), comm.rank, comm.size)
            loss = engine(x, y)
            if inf_at == engine.global_steps and comm.rank == 1:
                loss = loss * float("inf")  # rank 1 overflows: the vote makes both skip
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def run(comm, cfg, steps=3, init=False, **kw):
    if init:
        with Init():
            model = build_model("tiny-gpt", seed=0, **GPT)
    else:
        model = build_model("tiny-gpt", seed=0, **GPT)
    engine = build_engine(model, cfg, comm)
    losses = train(engine, steps, **kw)
    return engine, losses


def params(engine):
    return torch.cat([v.reshape(-1).float() for v in engine.full_state_dict().values()])


def compare(a, b):
    return {"bitwise": bool(torch.equal(a, b)), "max_abs": (a - b).abs().max().item()}


def main(comm, tmp):
    out = {}
    # 1. offload == no offload: SGD bitwise (fused SGD runs the same float ops), Adam within lr/10
    for stage in (1, 2, 3):
        for name, opt in (("sgd", SGD), ("adam", ADAM)) if stage == 2 else (("sgd", SGD),):
            ref = params(run(comm, config(stage, opt))[0])
            engine, _ = run(comm, config(stage, opt, offload={"device": "cpu"}))
            out[f"{stage}/{name}"] = compare(params(engine), ref)
        out[f"{stage}/traffic"] = engine.offload_traffic()
        out[f"{stage}/shard_numel"] = sum(p.numel() for p in engine.offload.device_params)
    # 2. fp16 at stages 2 and 3: the paper's 2 + 2 bytes per element of the shard; ledger by location (SGD)
    out["fp16"] = fp16_layouts(comm)
    # 3. ZeRO-Infinity: the same numbers as the cpu tier, the files' bytes counted
    nvme = os.path.join(tmp, f"nvme{comm.rank}")
    engine, _ = run(comm, config(3, offload={"device": "nvme", "nvme_path": nvme}, sub_group_size=1000))
    out["nvme/traffic"] = engine.offload_traffic()  # before params(): reading the state for it reads files too
    cpu_tier = params(run(comm, config(3, offload={"device": "cpu"}))[0])
    out["nvme"] = compare(params(engine), cpu_tier)
    out["nvme/ledger"] = engine.memory().as_dict()["detail"]
    out["nvme/shard_numel"] = engine.offload.numel
    out["nvme/sub_groups"] = len(engine.offload.bounds)
    # ... and the parameter shards in files too (offload_param nvme): mapped files hold the values the run trains
    cfg = config(3, offload={"device": "nvme", "nvme_path": nvme}, sub_group_size=1000)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    files, _ = run(comm, cfg)
    out["nvme_param/traffic"] = files.offload_traffic()
    out["nvme_param/ledger"] = files.memory().as_dict()["detail"]
    out["nvme_param/shard_numel"] = files.offload.numel
    names = sorted(os.listdir(files.offload.param_dir))
    out["nvme_param/files_hold_the_values"] = len(names) == len(files.offload.device_params) and all(
        np.array_equal(np.fromfile(os.path.join(files.offload.param_dir, name), dtype=np.float32),
                       q.detach().reshape(-1).numpy()) for name, q in zip(names, files.offload.device_params))
    mapped = {q.untyped_storage().data_ptr() for q in files.offload.device_params}
    out["nvme_param/local_parts_in_files"] = all(q.untyped_storage().data_ptr() in mapped
                                                 for q in files.wrapped.parameters())
    out["nvme_param"] = compare(params(files), cpu_tier)
    del files
    peaks = {}
    for sub in (500, 5000):
        peaks[sub] = run(comm, config(3, offload={"device": "nvme", "nvme_path": nvme}, sub_group_size=sub),
                         steps=2)[0].offload.buffer_peak
    out["nvme/transient_peak"] = peaks
    # disk full while writing: a clear error on the step; the checkpoint saved before is untouched
    ckpt = os.path.join(tmp, "ckpt_full")
    engine.save_checkpoint(ckpt)
    before = sorted(os.listdir(os.path.join(ckpt, "global_step3")))

    def full(path):
        raise OSError(28, "No space left on device", path)
    infinity._write_hook = full
    try:
        train(engine, 1)
        out["disk_full"] = "no error"
    except OSError as e:
        out["disk_full"] = f"{type(e).__name__}: {e}"
    finally:
        infinity._write_hook = None
    out["disk_full/ckpt_intact"] = sorted(os.listdir(os.path.join(ckpt, "global_step3"))) == before and \
        open(os.path.join(ckpt, "latest")).read() == "global_step3"
    # 4. DPU: identical before the warm-up ends, delayed after; an fp16 overflow drops its step
    plain = run(comm, config(2, ADAM, offload={"device": "cpu"}), steps=5)[1]
    engine, dpu = run(comm, config(2, ADAM, offload={"device": "cpu", "dpu_warmup_steps": 2}), steps=5)
    out["dpu"] = {"plain": plain, "dpu": dpu, "cpu_steps": engine.offload.steps}
    engine, losses = run(comm, config(3, ADAM, fp16=True, offload={"device": "cpu", "dpu_warmup_steps": 1}), steps=5,
                         inf_at=3)
    finite = bool(torch.isfinite(params(engine)).all())  # full_state_dict() lands the step in flight
    state = engine.offload.optim.state
    out["dpu/overflow"] = {"skipped": engine.skipped_steps, "cpu_steps": engine.offload.steps,
                           "adam_steps": sorted({float(s["step"]) for s in state.values()}),
                           "finite": finite, "losses": losses}
    # 5. zero.Init: the same training as a whole build; memory while building FSDP
    a = params(run(comm, config(3, offload={"device": "cpu"}), init=True)[0])
    out["init"] = compare(a, params(run(comm, config(3, offload={"device": "cpu"}))[0]))
    # 6. checkpoints: resume bitwise with offload on (cpu at stage 2, nvme at stage 3), and into no offload
    for name, cfg in (("cpu", config(2, ADAM, offload={"device": "cpu", "dpu_warmup_steps": 1})),
                      ("nvme", config(3, ADAM, offload={"device": "nvme", "nvme_path": nvme}, sub_group_size=700))):
        path = os.path.join(tmp, f"ckpt_{name}")
        engine, _ = run(comm, cfg, steps=2)
        engine.save_checkpoint(path)
        more = train(engine, 2)
        engine.offload.finish()  # DPU: the update in flight is part of the state compared
        saved = checkpoint.gather(engine)[0]
        again = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
        again.load_checkpoint(path)
        resumed = train(again, 2)
        again.offload.finish()
        now = checkpoint.gather(again)[0]
        out[f"resume/{name}"] = {"losses": more == resumed,
                                 "state": all(torch.equal(saved[n][k], now[n][k]) for n in saved for k in saved[n])}
        plain = build_engine(build_model("tiny-gpt", seed=0, **GPT), config(2 if name == "nvme" else 3, ADAM), comm)
        plain.load_checkpoint(path)
        loaded = checkpoint.gather(plain)[0]
        ref = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
        ref.load_checkpoint(path)
        want = checkpoint.gather(ref)[0]
        out[f"reshard/{name}"] = all(torch.equal(want[n][k], loaded[n][k]) for n in want for k in want[n])
    out["strict"] = strict_matrix(comm, tmp)
    out["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def fp16_layouts(comm):
    """ZeRO-2 and ZeRO-3 + cpu offload in fp16 (SGD momentum: 4 bytes of state, no step counters; no persistent
    parameters): the ledger after 2 steps, the last step's traffic, and the shard size the estimator needs."""
    out = {}
    for stage in (2, 3):
        engine, _ = run(comm, config(stage, fp16=True, offload={"device": "cpu"}, stage3_param_persistence_threshold=0),
                        steps=2)
        out[stage] = {"ledger": engine.memory().as_dict()["detail"], "traffic": engine.offload_traffic(),
                      "shard_numel": sum(p.numel() for p in engine.offload.device_params),
                      "device_dtypes": sorted({str(p.dtype) for p in engine.offload.device_params}),
                      "micro_batches": ACC, "skipped": engine.skipped_steps}
    return out


def strict_matrix(comm, tmp):
    """Every offload family through minizero.initialize, as a user sets it (AdamW, clipping 1.0, 2 micro-batches),
    twice: with MINIZERO_STRICT_HOST=1, where a host tensor reaching a collective raises as NCCL does on a GPU
    (and host and device tensors in one op as torch does there), and without. {name: error text, or whether
    the two runs' losses, last gradient norm and final parameters are bitwise equal}."""
    import minizero

    def cfg(stage, dtype="fp32", clip=1.0, opt="cpu", param=None, **zero):
        c = config(stage, ADAM, fp16=dtype == "fp16", offload={"device": opt}, param=param, **zero)
        if opt == "nvme":
            c["zero_optimization"]["offload_optimizer"]["nvme_path"] = os.path.join(tmp, f"strict{comm.rank}")
        if param == "nvme":
            c["zero_optimization"]["offload_param"]["nvme_path"] = os.path.join(tmp, f"strict{comm.rank}")
        return {**c, "gradient_clipping": clip, "bf16": {"enabled": dtype == "bf16"}}
    cases = {f"{stage}/{dtype}": cfg(stage, dtype) for stage in (1, 2, 3) for dtype in ("fp32", "bf16", "fp16")}
    cases.update({"2/fp32/no-clip": cfg(2, clip=0.0),
                  "2/fp32/dpu": cfg(2),
                  "3/fp32/nvme": cfg(3, opt="nvme", sub_group_size=1000),
                  "3/bf16/param-cpu": cfg(3, "bf16", param="cpu"),
                  "3/fp32/param-nvme": cfg(3, opt="nvme", param="nvme", sub_group_size=1000),
                  "3/fp32/zero-init": cfg(3, param="cpu")})
    cases["2/fp32/dpu"]["zero_optimization"]["offload_optimizer"]["dpu_warmup_steps"] = 1
    out = {}
    for name, c in cases.items():
        losses = []
        for strict in ("1", "0"):
            os.environ["MINIZERO_STRICT_HOST"] = strict
            try:
                if name.endswith("zero-init"):
                    with minizero.zero.Init():
                        model = build_model("tiny-gpt", seed=0, **GPT)
                else:
                    model = build_model("tiny-gpt", seed=0, **GPT)
                engine = minizero.initialize(model=model, model_parameters=model.parameters(), config=c)[0]
                losses.append(train(engine, 2) + [engine.get_global_grad_norm()])
                if name in ("2/fp32", "3/fp32/nvme"):  # a checkpoint's save and load gather and scatter
                    path = os.path.join(tmp, f"strict_ckpt_{name.replace('/', '_')}")
                    engine.save_checkpoint(path)
                    engine.load_checkpoint(path)
                losses[-1].append(params(engine).tolist())
            except Exception as e:  # every rank raises the same, before any peer waits on it
                out[name] = f"{'strict' if strict == '1' else 'plain'}: {type(e).__name__}: {e}"
                break
            finally:
                del os.environ["MINIZERO_STRICT_HOST"]
        else:
            out[name] = losses[0] == losses[1]
    return out


def layouts_job(comm):
    """The fp16 layouts alone, for a launch at another world size."""
    return fp16_layouts(comm)


def job(comm):
    with tempfile.TemporaryDirectory(prefix="minizero-offload-") as own:
        tmp = comm.allgather_object(own)[0]  # rank 0's directory: checkpoints are shared by the ranks
        out = main(comm, tmp)
        comm.barrier()  # nobody removes rank 0's directory while another rank still reads it
        return out
