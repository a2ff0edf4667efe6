"""Workers the pipeline tests launch: several configurations per launch (start-up dominates)."""
import torch

from minizero_course.experiments.pipeline import GPT, train


def suite(comm, configs, steps=5):
    """Every configuration of tests/test_pipeline.py, then torch DDP on the whole world with the
    global batch of the dp x pp = 2 x 2 configurations (micro 2 x m 4 x dp 2 = 16), then the engine,
    then PP + ZeRO-1/2/3 at dp 2 x pp 2 (experiments.pp_zero)."""
    from minizero_course.experiments.references import train_torch_ddp
    runs = [train(comm, schedule, p, m, v, steps=steps, dp_mode=dp_mode, return_params=(p, m, dp_mode) == (2, 4, "ddp"))
            for schedule, p, m, v, dp_mode in configs]
    cfg = {**GPT, "n_layer": 2}
    ref = train_torch_ddp(comm, "tiny-gpt", steps=steps, global_batch=16, lr=0.1, seed=0, optimizer="sgd",
                          model_kwargs=cfg, data_seed=1)
    from minizero_course.experiments.pp_zero import measure
    return {"runs": runs, "torch_ddp_params": ref["params"], "engine": engine_runs(comm),
            "verbose": verbose_trace(comm),
            "checkpointing": checkpointing_runs(comm), "pp_zero": measure(comm, steps=1, lost=("zero2-every",))}


def checkpointing_runs(comm, steps=3):
    """The pipeline engine with and without DeepSpeed's activation_checkpointing section, every schedule at
    dp 2 x pp 2 and 1F1B at pp 2 x tp 2 (ZeRO-1, SGD with momentum): per run, a SHA-256 of this rank's
    parameters after `steps` steps, the losses, and the runtime's peak bytes held for backward."""
    import hashlib

    import minizero
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    from minizero.models import GPTConfig, TinyGPT
    layouts = [({"stages": 2, "schedule": name, **({"chunks": 2} if name == "interleaved_1f1b" else {})}, 1)
               for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")] + [({"stages": 2, "schedule": "1f1b"}, 2)]
    out = []
    for pipeline, tp in layouts:
        for checkpointing in (False, True):
            dp = comm.size // (2 * tp)
            config = {"train_batch_size": 8 * dp, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                      "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                      "zero_optimization": {"stage": 1}, "pipeline": pipeline, "tensor_parallel": {"autotp_size": tp}}
            if checkpointing:
                config["activation_checkpointing"] = {}
            cfg = GPTConfig(**{**GPT, "n_layer": 4})
            engine, _, _, _ = minizero.initialize(model=TinyGPT(cfg), config=config, comm=comm)
            losses, peak = [], 0
            for x, y in global_batches(TinyGPT(cfg), steps, 8 * dp, seed=3):
                mine = shard((x, y), engine.dp_rank, engine.dp_size)
                losses.append(engine.train_batch(iter(list(zip(mine[0].chunk(4), mine[1].chunk(4))))).item())
                peak = max(peak, engine.runtime.last["peak_activation_bytes"])
            digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in engine.pipeline.parameters()))
            out.append({"layout": [pipeline["schedule"], tp], "checkpointing": checkpointing, "losses": losses,
                        "params": digest.hexdigest(), "peak_activation_bytes": peak,
                        "checkpointed": len(engine.checkpointed_blocks)})
    return out


def verbose_trace(comm):
    """What verbose=True prints on this rank for one ZB-H1 step at p = 4, m = 2 (picotron's VERBOSE)."""
    import contextlib
    import io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(comm, "zb_h1", 4, 2, steps=1, reference=False, verbose=True)
    return printed.getvalue()


def dies_mid_pipeline(comm, kill_rank=1, kill_microbatch=2):
    """Rank `kill_rank` is killed by the OS (SIGKILL: no traceback) in the forward of a micro-batch."""
    import os
    import signal

    from minizero.comm import Mesh
    from minizero_course.experiments.references import global_batches
    from minizero.models import GPTConfig, TinyGPT
    from minizero.pipeline import PipelineRuntime, PipelineStage
    mesh = Mesh(comm, pp=comm.size)
    cfg = GPTConfig(**{**GPT, "n_layer": comm.size})
    full = TinyGPT(cfg)
    seen = []

    def hook(module, args):
        seen.append(1)
        if comm.rank == kill_rank and len(seen) == kill_microbatch + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    full.h[kill_rank].register_forward_pre_hook(hook)
    stage = PipelineStage(full.pipeline_parts(), mesh, (2, cfg.block_size, cfg.n_embd))
    x, y = global_batches(full, 1, 8)[0]
    PipelineRuntime(stage, "1f1b", 4).step(x, y)
    return "finished"


def engine_runs(comm, steps=3, clip=0.05):
    """minizero.initialize with a pipeline section (dp 2 x pp 2), SGD + gradient clipping, against one
    process clipping with torch.nn.utils.clip_grad_norm_: the largest parameter difference per run."""
    import minizero
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches, make_optimizer
    from minizero.models import GPTConfig, TinyGPT
    runs = [({"stage": 0}, {"stages": 2, "schedule": "1f1b"}),
            ({"stage": 1}, {"stages": 2, "schedule": "zb_h1"}),
            ({"stage": 1}, {"stages": 2, "schedule": "interleaved_1f1b", "chunks": 2})]
    out = []
    for zero, pipeline in runs:
        cfg = GPTConfig(**{**GPT, "n_layer": 4})
        config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                  "zero_optimization": zero, "pipeline": pipeline}
        model = TinyGPT(cfg)
        names = {id(q): n for n, q in model.named_parameters()}
        engine, _, _, _ = minizero.initialize(model=model, config=config, comm=comm)
        ref = TinyGPT(cfg)
        opt = make_optimizer("sgd", ref.parameters(), 0.1)
        losses, ref_losses, norms, ref_norms = [], [], [], []
        for x, y in global_batches(ref, steps, 16, seed=3):
            mine = shard((x, y), engine.mesh.dp_rank, engine.mesh.dp_size)
            micro = list(zip(mine[0].chunk(4), mine[1].chunk(4)))
            losses.append(engine.train_batch(iter(micro)).item())
            norms.append(engine.get_global_grad_norm())
            loss = ref(x, y)[1]
            loss.backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
        want = dict(ref.named_parameters())
        worst = max(((q.detach() - want[names[id(q)]].detach()).abs()
                     - 1e-6 * want[names[id(q)]].detach().abs()).max().item() for q in engine.pipeline.parameters())
        out.append({"config": [zero, pipeline], "atol_needed": worst, "losses": losses, "ref_losses": ref_losses,
                    "norms": norms, "ref_norms": ref_norms})
    return out


def three_d_runs(comm, steps=5, clip=0.05):
    """3D through minizero.initialize: pipeline.stages 2 x tensor_parallel.autotp_size 2 x the rest data
    parallel (dp 2 on 8 ranks, 1 on 4), ZeRO-0 and ZeRO-1, SGD with momentum and gradient clipping,
    against one process on the whole batch: the largest atol needed at rtol 1e-6 after `steps` steps,
    every rank's stage gathered over its tp group into the single-process tensors, and the losses and norms."""
    import minizero
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches, make_optimizer
    from minizero.models import GPTConfig, TinyGPT
    from minizero.planner import ModelShape, ParallelStrategy, plan
    from minizero.planner.plan import SCHEDULES
    from minizero.tensor.layers import unshard
    runs = [({"stage": 1}, {"stages": 2, "schedule": "1f1b"}, True),
            ({"stage": 0}, {"stages": 2, "schedule": "gpipe"}, False),
            ({"stage": 1}, {"stages": 2, "schedule": "interleaved_1f1b", "chunks": 2}, True)]
    out = []
    for zero, pipeline, tied in runs:
        cfg = GPTConfig(**{**GPT, "n_layer": 4, "tie_weights": tied})
        dp = comm.size // 4
        config = {"train_batch_size": 8 * dp, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                  "zero_optimization": zero, "pipeline": pipeline, "tensor_parallel": {"autotp_size": 2}}
        engine, _, _, _ = minizero.initialize(model=TinyGPT(cfg), config=config, comm=comm)
        names = {id(q): n for n, q in engine.module.named_parameters()}
        ref = TinyGPT(cfg)
        opt = make_optimizer("sgd", ref.parameters(), 0.1)
        losses, ref_losses, norms, ref_norms = [], [], [], []
        for x, y in global_batches(ref, steps, 8 * dp, seed=3):
            mine = shard((x, y), engine.dp_rank, engine.dp_size)
            micro = list(zip(mine[0].chunk(4), mine[1].chunk(4)))
            comm.stats.reset()  # the last step's bytes stay: every step sends the same
            losses.append(engine.train_batch(iter(micro)).item())
            sent, sent_by_op = comm.stats.sent(), comm.stats.as_dict()
            norms.append(engine.get_global_grad_norm())
            loss = ref(x, y)[1]
            loss.backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
        want = dict(ref.named_parameters())
        worst, checked = 0.0, []
        for q in engine.pipeline.parameters():
            full = q.detach()
            if hasattr(q, "tensor_parallel_dim"):  # this rank's slice: the tp group's slices make the tensor
                parts = torch.empty((engine.mesh.tp_size, *full.shape), dtype=full.dtype)
                engine.mesh.tp.all_gather(parts, full.contiguous())
                full = unshard(list(parts.unbind(0)), q.tensor_parallel_dim, q.tensor_parallel_chunks)
            ref_q = want[names[id(q)]].detach()
            worst = max(worst, ((full - ref_q).abs() - 1e-6 * ref_q.abs()).max().item())
            checked.append(names[id(q)])
        planned = None
        if pipeline["schedule"] in SCHEDULES:  # the planner's per-rank bytes for this layout
            shape = ModelShape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size, tied)
            strategy = ParallelStrategy(comm.size, node_size=4, tp=2, pp=2, zero=zero["stage"], micro_batch=2,
                                micro_batches=4, schedule=pipeline["schedule"], precision="fp32", optimizer="sgd")
            planned = plan(shape, strategy).stages[engine.mesh.pp_rank].sent
        out.append({"config": [zero, pipeline, tied], "coords": [engine.mesh.dp_rank, engine.mesh.pp_rank,
                                                                 engine.mesh.tp_rank], "planned_sent": planned,
                    "atol_needed": worst, "checked": sorted(set(checked)), "losses": losses,
                    "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
                    "sent": sent, "sent_by_op": sent_by_op})
    return out
