"""A training script in the style of DeepSpeed's examples (DeepSpeedExamples' cifar10_deepspeed.py and
pipeline_parallelism/train.py): argparse + add_config_arguments, init_distributed, get_accelerator, the comm
calls, set_random_seed, RepeatingLoader, DeepSpeedCPUAdam, initialize(args=...), backward/step, save/load
checkpoint, then a PipelineModule trained with train_batch. Its only change from DeepSpeed is the import line.

Started by tests/test_deepspeed_surface.py as
    python -m minizero.launcher --num_gpus 2 deepspeed_style_train.py --deepspeed --deepspeed_config ds.json
      --save_dir DIR
it prints one line `RESULT {json}` on rank 0 with what the test asserts.
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.nn as nn

import minizero as deepspeed  # the one changed line: `import deepspeed`
from minizero.accelerator import get_accelerator
from minizero.pipe import LayerSpec, PipelineModule
from minizero.runtime.utils import set_random_seed
from minizero.utils import RepeatingLoader


def add_argument():
    parser = argparse.ArgumentParser(description="DeepSpeed-style")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def dataset(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4] - x[:, 4:]).argmax(dim=1)  # a rule the net can learn
    return torch.utils.data.TensorDataset(x, y)


def gathered(world, value: float) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    deepspeed.comm.all_gather(out, t)
    return [o.item() for o in out]


def main():
    args = add_argument()
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    acc = get_accelerator()
    out = {"world": world, "local_rank_args": gathered(world, args.local_rank),
           "ranks_env": gathered(world, int(os.environ["RANK"])), "local_rank_env": int(os.environ["LOCAL_RANK"]),
           "deepspeed_flag": args.deepspeed, "get_local_rank": deepspeed.comm.get_local_rank(),
           "device_name": acc.device_name(), "current_device": acc.current_device(), "device_count": acc.device_count(),
           "current_device_name": acc.current_device_name(), "is_available": acc.is_available(),
           "memory_allocated": acc.memory_allocated(), "backend": acc.communication_backend_name()}
    acc.synchronize()

    # comm: values every rank can check, and the bytes minizero counted for them
    stats = deepspeed.comm.get_world_group().stats
    stats.reset()
    t = torch.tensor([float(rank + 1)] * 4)
    deepspeed.comm.all_reduce(t)
    out["all_reduce_sum"] = t.tolist()
    t = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(t, op=deepspeed.comm.ReduceOp.AVG)
    out["all_reduce_avg"] = t.item()
    t = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    out["all_reduce_max"] = t.item()
    t = torch.tensor([10.0 * rank])
    deepspeed.comm.broadcast(t, src=1)
    out["broadcast_from_1"] = t.item()
    deepspeed.comm.barrier()
    out["all_reduce_bytes"] = stats.sent("all_reduce")  # 16 + 4 + 4 payload bytes
    whole = torch.zeros(2 * world)
    deepspeed.comm.all_gather_into_tensor(whole, torch.tensor([rank, rank + 0.5]))
    out["all_gather_into_tensor"] = whole.tolist()
    names = [None] * world
    deepspeed.comm.all_gather_object(names, f"rank{rank}")
    out["all_gather_object"] = names
    out["summary_ops"] = sorted(deepspeed.comm.log_summary(return_dict=True))

    # set_random_seed: the same draws on every rank, and again after reseeding
    set_random_seed(1234)
    draws = [random.random(), float(np.random.rand()), torch.rand(1).item()]
    set_random_seed(1234)
    out["seed_repeats"] = draws == [random.random(), float(np.random.rand()), torch.rand(1).item()]
    out["seed_same_on_ranks"] = len(set(gathered(world, sum(draws)))) == 1

    # the plain engine, cifar10_deepspeed.py's loop
    net = Net()
    with open(args.deepspeed_config) as f:
        cfg = json.load(f)
    # the config's optimizer, or DeepSpeed's CPU Adam built by the script when the config names none
    optimizer = None if "optimizer" in cfg else deepspeed.ops.adam.DeepSpeedCPUAdam(net.parameters(), lr=0.02)
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, optimizer=optimizer, training_data=dataset())
    device = acc.current_device_name()
    criterion = nn.CrossEntropyLoss()
    data_iter = RepeatingLoader(trainloader)
    per_epoch = len(trainloader)
    losses = []
    for step in range(args.steps * model_engine.gradient_accumulation_steps()):
        inputs, labels = next(data_iter)
        loss = criterion(model_engine(inputs.to(device)), labels.to(device))
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    out["micro_steps"] = len(losses)
    out["batches_per_epoch"] = per_epoch
    out["global_steps"] = model_engine.global_steps
    out["loss_first_epoch"] = sum(losses[:per_epoch]) / per_epoch
    out["loss_last_epoch"] = sum(losses[-per_epoch:]) / per_epoch
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    out["weights_equal_on_ranks"] = len(set(gathered(world, weights.double().sum().item()))) == 1

    model_engine.save_checkpoint(args.save_dir, tag="ckpt", client_state={"step": len(losses)})
    saved = model_engine.full_state_dict()
    for _ in range(model_engine.gradient_accumulation_steps()):  # one more optimizer step
        inputs, labels = next(data_iter)
        model_engine.backward(criterion(model_engine(inputs), labels))
        model_engine.step()
    moved = model_engine.full_state_dict()
    _, client = model_engine.load_checkpoint(args.save_dir, tag="ckpt")
    loaded = model_engine.full_state_dict()
    out["client_state"] = client
    out["moved_after_save"] = max((moved[k] - saved[k]).abs().max().item() for k in saved)
    out["loaded_vs_saved"] = max((loaded[k] - saved[k]).abs().max().item() for k in saved)

    # pipeline_parallelism/train.py's shape: a PipelineModule of LayerSpecs, train_batch over a RepeatingLoader
    set_random_seed(0)
    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), *[LayerSpec(Block, 16) for _ in range(4)],
                                 LayerSpec(nn.Linear, 16, 4)],
                         num_stages=2, loss_fn=nn.CrossEntropyLoss(), hidden_shape=(16,))
    out["pipe_param_names"] = [n for n, _ in net.named_parameters()][:3]
    cfg = {**cfg, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "pipeline": {"stages": 2}, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "Adam", "params": {"lr": 0.02}}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)  # model_parameters: refused with a pipeline
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2, shuffle=False)
    pipe_iter = RepeatingLoader(loader)
    pipe_losses = [float(engine.train_batch(pipe_iter)) for _ in range(10)]
    out["pipe_first"], out["pipe_last"] = pipe_losses[0], pipe_losses[-1]
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
