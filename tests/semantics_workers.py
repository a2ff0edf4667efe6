"""DeepSpeed's engine semantics on 2 ranks (tests/test_deepspeed_semantics.py, ONE job).

Ground truth is computed in the same job: the same model trained with plain torch (its gradients averaged over
the ranks by hand), and the same engine given the summed loss in one backward. fp32 throughout: only the
order of summation differs, so the comparisons hold to 1e-6.
"""
import warnings

import torch
import torch.nn as nn

import minizero
from minizero.runtime.config import ConfigError

STAGES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu")]


def error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError, TypeError, KeyError, NotImplementedError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def config(stage, offload, lr=1e-2):
    zero = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.5, 0.999]}}}


def data(comm, step, part, shape):
    gen = torch.Generator().manual_seed(100 * step + 10 * part + comm.rank)  # each rank its own batch
    return torch.randn(*shape, generator=gen)


def mlp(seed, n_in=4, n_out=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, 8), nn.Tanh(), nn.Linear(8, n_out))


def averaged_grads(comm, module):
    """torch DDP's gradients: each .grad averaged over the ranks."""
    for p in module.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad)
            p.grad.div_(comm.size)


def full(engine):
    return torch.cat([t.reshape(-1).float() for t in engine.full_state_dict().values()])


def plain(module):
    return torch.cat([t.detach().reshape(-1).float() for t in module.state_dict().values()])


def several_backwards(comm):
    """Two backward calls then one step (a GAN discriminator's real and fake halves) against one backward of
    their sum and against torch's accumulation, at every stage and with offload; 2 steps."""
    out = {}
    reference = mlp(0)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2, betas=(0.5, 0.999))
    for step in range(2):
        opt.zero_grad()
        for part in range(2):
            nn.functional.mse_loss(reference(data(comm, step, part, (4, 4))), torch.zeros(4, 1)).backward()
        averaged_grads(comm, reference)
        opt.step()
    for stage, offload in STAGES:
        runs = {}
        for how in ("two", "summed"):
            engine, _, _, _ = minizero.initialize(model=mlp(0), config=config(stage, offload), comm=comm)
            for step in range(2):
                losses = [nn.functional.mse_loss(engine(data(comm, step, part, (4, 4))), torch.zeros(4, 1))
                          for part in range(2)]
                if how == "two":
                    engine.backward(losses[0])
                    engine.backward(losses[1])
                else:
                    engine.backward(losses[0] + losses[1])
                engine.step()
            runs[how] = full(engine)
        key = f"{stage}/{offload}"
        out[key] = {"two_vs_summed": (runs["two"] - runs["summed"]).abs().max().item(),
                    "two_vs_torch": (runs["two"] - plain(reference)).abs().max().item(),
                    "moved": (runs["two"] - plain(mlp(0))).abs().max().item()}
    return out


def gan(comm):
    """DeepSpeed's DCGAN example's loop (DeepSpeedExamples training/gan): D steps on real and fake (two
    backward calls), then G's loss backpropagates through D's module into G's engine; netD.zero_grad() at the
    next iteration drops what G's backward left in D. Against the same loop in plain torch."""
    out = {}
    bce = nn.BCEWithLogitsLoss()

    def loop(net_d, net_g, backward_d, backward_g, step_d, step_g, d_forward, g_forward, sync=None):
        for it in range(2):
            net_d.zero_grad()
            real = data(comm, it, 0, (4, 4))
            backward_d(bce(d_forward(real), torch.ones(4, 1)))
            fake = g_forward(data(comm, it, 1, (4, 2)))
            backward_d(bce(d_forward(fake.detach()), torch.zeros(4, 1)))
            if sync is not None:
                sync(net_d)
            step_d()
            net_g.zero_grad()
            backward_g(bce(d_forward(fake), torch.ones(4, 1)))
            if sync is not None:
                sync(net_g)
            step_g()

    net_d, net_g = mlp(1), mlp(2, n_in=2, n_out=4)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-2, betas=(0.5, 0.999))
    loop(net_d, net_g, lambda loss: loss.backward(), lambda loss: loss.backward(), opt_d.step, opt_g.step, net_d, net_g,
         sync=lambda m: averaged_grads(comm, m))
    reference_d, reference_g = plain(net_d), plain(net_g)
    for stage, offload in STAGES:
        key = f"{stage}/{offload}"
        net_d, net_g = mlp(1), mlp(2, n_in=2, n_out=4)
        engine_d, _, _, _ = minizero.initialize(model=net_d, config=config(stage, offload), comm=comm)
        engine_g, _, _, _ = minizero.initialize(model=net_g, config=config(stage, offload), comm=comm)
        error = error_of(lambda: loop(engine_d.module, engine_g.module, engine_d.backward, engine_g.backward,
                                      engine_d.step, engine_g.step, engine_d, engine_g))
        if error is not None:
            out[key] = {"error": error}
            continue
        out[key] = {"d_vs_torch": (full(engine_d) - reference_d).abs().max().item(),
                    "g_vs_torch": (full(engine_g) - reference_g).abs().max().item(),
                    "g_moved": (full(engine_g) - plain(mlp(2, n_in=2, n_out=4))).abs().max().item()}
    return out


def client_optimizer(comm):
    """initialize(optimizer=...) with an 'optimizer' section too: the client's is used (its lr, its class),
    as DeepSpeed's _configure_optimizer does; rank 0 warns."""
    model = mlp(0)
    cfg = config(1, "none", lr=0.5)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, scheduler = minizero.initialize(
            model=model, config=cfg, comm=comm, optimizer=torch.optim.SGD(model.parameters(), lr=0.125),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    return {"class": optimizer.optimizer_cls.__name__, "lr": engine.get_lr()[0], "scheduler": type(scheduler).__name__,
            "warnings": [str(w.message) for w in caught if "overrides the config" in str(w.message)]}


def run_all(comm):
    return {"client_optimizer": client_optimizer(comm), "several_backwards": several_backwards(comm),
            "gan": gan(comm), "pipeline": pipeline(comm), "bf16_masters": bf16_masters(comm)}


def pipeline(comm):
    """DeepSpeedExamples' pipeline_parallelism/train.py: a PipelineModule of LayerSpecs, num_stages read from it
    (no pipeline section), initialize(model_parameters=, training_data=), then engine.train_batch() with no
    iterator; eval_batch; the accessors. Against the same layers trained whole in torch on the same batches."""
    from minizero.pipe import LayerSpec, PipelineModule
    layers = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 8),
              LayerSpec(nn.Linear, 8, 1)]

    def build(num_stages=2):
        torch.manual_seed(0)
        return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=nn.MSELoss(), hidden_shape=(8,))

    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(40, 4, generator=gen), torch.randn(40, 1, generator=gen)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    net = build()
    engine, _, loader, _ = minizero.initialize(model=net, config=cfg, comm=comm,
                                               model_parameters=[p for p in net.parameters() if p.requires_grad],
                                               training_data=torch.utils.data.TensorDataset(x, y))
    out = {"accessors": [type(engine).__name__, engine.num_stages, engine.stage_id, engine.is_first_stage(),
                         engine.is_last_stage(), engine.micro_batches, engine.get_pipeline_parallel_rank(),
                         loader is engine.training_dataloader]}
    out["losses"] = [engine.train_batch().item() for _ in range(3)]
    out["eval"] = engine.eval_batch(iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[24:], y[24:]),
                                                                     batch_size=2))).item()
    out["training_after_eval"] = engine.train_batch().item()
    reference = build()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out["torch"] = []
    for step in range(3):  # the loader's order (dp = 1: every sample, in order); mean of the 4 micro-batch means
        rows = slice(8 * step, 8 * step + 8)
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(reference(xs), ys) for xs, ys in zip(x[rows].chunk(4), y[rows].chunk(4))) / 4
        loss.backward()
        opt.step()
        out["torch"].append(loss.item())
    with torch.no_grad():
        out["torch_eval"] = (sum(nn.functional.mse_loss(reference(xs), ys)
                                 for xs, ys in zip(x[24:32].chunk(4), y[24:32].chunk(4))) / 4).item()
    out["errors"] = {
        "stages_differ": error_of(lambda: minizero.initialize(model=build(), config={**cfg, "pipeline": {"stages": 1}},
                                                              comm=comm)),
        "eval_logits": error_of(lambda: engine.eval_batch(iter([(x[:2], y[:2])] * 4), return_logits=True)),
    }
    return out


def bf16_masters(comm):
    """bf16.bf16_master_weights_and_grads + bf16_optimizer_states at ZeRO 1 and 2: the optimizer steps the bf16
    shard with a bf16 gradient and keeps Adam's moments in bf16. Against plain torch stepping the bf16 model
    itself (its bf16 gradients averaged over the ranks), the ledger against the formula, and the refusals."""
    out = {}
    torch.manual_seed(0)
    reference = mlp(0).to(torch.bfloat16)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2, betas=(0.5, 0.999))
    for step in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(reference(data(comm, step, 0, (4, 4)).bfloat16()).float(), torch.zeros(4, 1)).backward()
        averaged_grads(comm, reference)
        opt.step()
    for stage in (1, 2):
        runs = {}
        for masters in (False, True):
            cfg = config(stage, "none")
            cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": masters, "bf16_optimizer_states": masters}
            engine, _, _, _ = minizero.initialize(model=mlp(0), config=cfg, comm=comm)
            for step in range(3):
                engine.backward(nn.functional.mse_loss(engine(data(comm, step, 0, (4, 4))).float(), torch.zeros(4, 1)))
                engine.step()
            inner = engine.optimizer.optim if hasattr(engine.optimizer, "optim") else engine.optimizer
            runs[masters] = {"params": torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()]),
                             "ledger": engine.memory().by_category,
                             "state_dtypes": sorted({str(t.dtype) for s in inner.state.values() for t in s.values()
                                                     if torch.is_tensor(t) and t.numel() > 1}),
                             "shard_numel": engine.strategy.optimizer.layout.shard_numel}
        mine = runs[True]["params"]
        theirs = plain(reference)
        ulp = theirs.abs().clamp_min(2 ** -8) * 2 ** -7  # one bf16 step at each value
        out[str(stage)] = {"vs_torch_ulps": ((mine - theirs).abs() / ulp).max().item(),
                      "vs_fp32_masters": (mine - runs[False]["params"]).abs().max().item(),
                      "state_dtypes": runs[True]["state_dtypes"], "fp32_state_dtypes": runs[False]["state_dtypes"],
                      "saved": {c: runs[False]["ledger"][c] - runs[True]["ledger"][c]
                                for c in ("master_params", "optimizer_state", "gradients", "parameters")},
                      "shard_numel": runs[True]["shard_numel"]}

    def refused(stage, **bf16):
        cfg = config(stage, "none")
        cfg["bf16"] = {"enabled": True, **bf16}
        return error_of(lambda: minizero.initialize(model=mlp(0), config=cfg, comm=comm))

    both = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    out["errors"] = {"stage0": refused(0, **both), "stage3": refused(3, **both),
                     "states_alone": refused(1, bf16_optimizer_states=True),
                     "masters_alone": refused(1, bf16_master_weights_and_grads=True),
                     "fp16_masters": error_of(lambda: minizero.initialize(model=mlp(0), comm=comm, config={
                         **config(1, "none"), "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}))}
    return out
