"""A training script in DeepSpeed's examples' own style (DeepSpeedExamples' training/cifar/cifar10_deepspeed.py),
run unchanged under real DeepSpeed and under minizero: only the import line differs, picked by PEER_LIBRARY
(`deepspeed` or `minizero`, the default).

    python -m minizero.launcher --num_gpus 2 peer_train.py --deepspeed --deepspeed_config ds.json --out_dir DIR
    DS_ACCELERATOR=cpu PEER_LIBRARY=deepspeed deepspeed --num_gpus 2 peer_train.py --deepspeed ...

One launch trains every variant given by --variants ("stage:precision[:scheduler]": precision fp32, bf16 or offload;
scheduler WarmupDecayLR or WarmupCosineLR instead of the base's) in turn, each from the same seed, for --steps
optimizer steps on the base config (--deepspeed_config) with the variant's sections added. Rank 0 prints one line
`RESULT {json}`: per variant the loss of every micro-step on each rank, the learning rate after every step, the
engine's accessors, and the checkpoint round trip (save with client_state, one more step, load, the same step
again).
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn

if os.environ.get("PEER_LIBRARY", "minizero") == "deepspeed":
    import deepspeed
    from deepspeed.pipe import PipelineModule
else:
    import minizero as deepspeed
    from minizero.pipe import PipelineModule


def add_argument():
    parser = argparse.ArgumentParser(description="peer")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--out_dir", type=str, required=True, help="variant configs and checkpoints go here")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per variant")
    parser.add_argument("--variants", type=str, default="0:fp32,1:fp32,2:fp32,3:fp32")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batches(n_batches, micro_batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches, micro_batch, 16, generator=g)
    y = (x[..., :4] - x[..., 4:8]).argmax(dim=-1)  # a rule the net can learn
    return x, y


def variant_config(base: dict, variant: str, steps: int) -> dict:
    stage, precision, *schedule = variant.split(":")
    cfg = json.loads(json.dumps(base))
    if schedule == ["frozen"]:  # the script's own torch optimizer replaces the section
        del cfg["optimizer"]
    if schedule == ["pipe"]:
        # DeepSpeed's pipeline clips by the first stage's gradient norm alone (runtime/utils.py
        # clip_grad_norm_ counts parameters only on model-parallel rank 0, and its pipeline grid
        # makes each stage a model-parallel rank); minizero's by the norm over every stage
        cfg["gradient_clipping"] = 0.0
    if schedule == ["WarmupDecayLR"]:  # the base's warm-up, linear, then down to 0 at the last step
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {**cfg["scheduler"]["params"], "warmup_type": "linear",
                                                                "total_num_steps": steps}}
    elif schedule == ["WarmupCosineLR"]:  # ratios of the optimizer's lr
        cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_min_ratio": 0.1,
                                                                 "warmup_num_steps": 3, "cos_min_ratio": 0.05}}
    cfg["zero_optimization"] = {"stage": int(stage)}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "offload":
        # DeepSpeed's own CPU Adam is a C++ op: a torch optimizer keeps this run free of op builds
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def gathered_dicts(value: dict, world: int) -> list:
    out = [None] * world
    deepspeed.comm.all_gather_object(out, value)
    return out


def gathered(value: float, world: int) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=deepspeed.accelerator.get_accelerator().current_device_name())
    out = [torch.zeros_like(t) for _ in range(world)]
    deepspeed.comm.all_gather(out, t)
    return [o.item() for o in out]


def train_variant(args, base: dict, variant: str, rank: int, world: int) -> dict:
    path = os.path.join(args.out_dir, f"{variant.replace(':', '_')}.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(variant_config(base, variant, args.steps), f)
    args.deepspeed_config = path
    deepspeed.runtime.utils.set_random_seed(1234)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    client = {}
    if variant.endswith(":frozen"):
        # a model that freezes part of itself and gives its optimizer every parameter, as torch
        # allows: the frozen ones never get a gradient, so torch's step skips them
        net.fc1.requires_grad_(False)
        client = {"optimizer": torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.9, 0.999),
                                                 eps=1e-8, weight_decay=0.01)}
        parameters = None
    started = time.perf_counter()
    model_engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, **client)
    init_s = time.perf_counter() - started
    local_device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else None
    if model_engine.fp16_enabled():
        target_dtype = torch.half
    gas = model_engine.gradient_accumulation_steps()
    micro = model_engine.train_micro_batch_size_per_gpu()
    xs, ys = batches((args.steps + 1) * gas * world, micro)
    criterion = nn.CrossEntropyLoss()

    def micro_step(i):
        inputs, labels = xs[i * world + rank].to(local_device), ys[i * world + rank].to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        loss = criterion(model_engine(inputs).float(), labels)
        model_engine.backward(loss)
        model_engine.step()
        return loss.item()

    frozen_at_start = [p.detach().clone() for p in net.parameters() if not p.requires_grad]
    losses, lrs, norms = [], [], []
    for i in range(args.steps * gas):
        losses.append(gathered(micro_step(i), world))
        lrs.append(model_engine.get_lr()[0])
        if (i + 1) % gas == 0:
            norm = model_engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    # the checkpoint round trip: save, one more step, load, the same step again gives the same losses
    ckpt = os.path.join(args.out_dir, "ckpt_" + variant.replace(":", "_"))
    model_engine.save_checkpoint(ckpt, client_state={"step": model_engine.global_steps})
    after_save = [micro_step(args.steps * gas + j) for j in range(gas)]
    load_path, client_state = model_engine.load_checkpoint(ckpt)
    after_load = [micro_step(args.steps * gas + j) for j in range(gas)]
    frozen = [p for p in net.parameters() if not p.requires_grad]
    return {"losses": losses, "lrs": lrs, "grad_norms": norms, "init_s": init_s,
            "frozen_unchanged": all(torch.equal(p, q) for p, q in zip(frozen, frozen_at_start)),
            "stage": model_engine.zero_optimization_stage(), "bf16": model_engine.bfloat16_enabled(),
            "fp16": model_engine.fp16_enabled(), "offload": bool(model_engine.zero_offload_optimizer()),
            "global_steps": model_engine.global_steps, "train_batch_size": model_engine.train_batch_size(),
            "local_rank": model_engine.local_rank, "device": str(model_engine.device),
            "client_step": client_state["step"], "load_path_found": load_path is not None,
            "after_save": after_save, "after_load": after_load,
            "optimizer_is_engines": optimizer is model_engine.optimizer, "has_scheduler": lr_scheduler is not None}


def train_two_engines(args, base: dict, variant: str, rank: int, world: int) -> dict:
    """Two engines alive at once (a classifier and a second, smaller one), stepped in turn on the same batches."""
    path = os.path.join(args.out_dir, f"{variant.replace(':', '_')}.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(variant_config(base, variant, args.steps), f)
    args.deepspeed_config = path
    deepspeed.runtime.utils.set_random_seed(1234)
    nets = [Net(), nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))]
    engines = [deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())[0] for net in nets]
    local_device = deepspeed.accelerator.get_accelerator().device_name(engines[0].local_rank)
    gas = engines[0].gradient_accumulation_steps()
    xs, ys = batches(args.steps * gas * world, engines[0].train_micro_batch_size_per_gpu(), seed=1)
    criterion = nn.CrossEntropyLoss()
    losses, lrs = [[], []], [[], []]
    for i in range(args.steps * gas):
        inputs, labels = xs[i * world + rank].to(local_device), ys[i * world + rank].to(local_device)
        for k, engine in enumerate(engines):
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            losses[k].append(gathered(loss.item(), world))
            lrs[k].append(engine.get_lr()[0])
    return {"losses": losses, "lrs": lrs, "global_steps": [e.global_steps for e in engines]}


def train_pipe(args, base: dict, variant: str, rank: int, world: int) -> dict:
    """A PipelineModule of 2 stages whose shape changes from layer to layer, given no shape: the
    engine learns what crosses between the stages (micro x 4 x 8 here) at the first step.
    train_batch's mean loss per step."""
    path = os.path.join(args.out_dir, f"{variant.replace(':', '_')}.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(variant_config(base, variant, args.steps), f)
    args.deepspeed_config = path
    deepspeed.runtime.utils.set_random_seed(1234)
    layers = [nn.Linear(16, 32), nn.ReLU(), lambda x: x.view(x.shape[0], 4, 8), nn.Linear(8, 8),
              nn.Tanh(), lambda x: x.flatten(1), nn.Linear(32, 4)]
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                         partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad])
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    xs, ys = batches(args.steps * gas, micro, seed=2)
    losses = []
    for step in range(args.steps):
        data = iter([(xs[step * gas + j], ys[step * gas + j]) for j in range(gas)])
        losses.append(float(engine.train_batch(data_iter=data)))
    return {"losses": losses, "stage_id": engine.stage_id, "num_stages": engine.num_stages}


def torch_distributed_after_init() -> dict:
    """What a DeepSpeed program may do once init_distributed returned: call torch.distributed
    itself."""
    import torch.distributed as dist
    world = getattr(deepspeed.comm, "get", lambda: None)()  # minizero's communicator
    before = world and world.stats.sent()
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    dist.barrier()
    between = world and world.stats.sent()
    deepspeed.comm.all_reduce(torch.ones(4))  # 16 bytes through the library's own collectives
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "backend": dist.get_backend(),
            "minizero_backend": world and world.backend,
            "minizero_sent": world and [between - before, world.stats.sent() - between]}


def main():
    args = add_argument()
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    probe = torch_distributed_after_init()
    with open(args.deepspeed_config) as f:
        base = json.load(f)
    out = {"world": world, "library": deepspeed.__name__, "variants": {},
           "torch_distributed": gathered_dicts(probe, world)}
    for variant in args.variants.split(","):
        train = (train_two_engines if variant.endswith(":two_engines") else
                 train_pipe if variant.endswith(":pipe") else train_variant)
        out["variants"][variant] = train(args, base, variant, rank, world)
        deepspeed.comm.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
