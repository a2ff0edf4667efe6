"""A training script in Accelerate's examples' style (examples/nlp_example.py's loop: set_seed,
main_process_first, prepare, accumulate, backward, clip under sync_gradients, optimizer/scheduler
steps, gather_for_metrics over an uneven last batch, trackers, save_state/load_state), with dropout,
so that the losses also depend on how often the prepared loaders draw from torch's global generator.

    ACCELERATE_USE_CPU=true torchrun --nproc-per-node 2 accelerate_style_train.py --peer accelerate --out a.json
    python -m minizero.accelerate.launch --config_file article.yaml accelerate_style_train.py --peer minizero ...

With --peer minizero the first run takes its settings from the launcher's variables (the article's config),
then the variables are cleared and the script runs again per --variants (ddp, zero1, zero2, zero3, fsdp):
the imports (`from accelerate ...` / `from minizero.accelerate ...`) are the only lines that differ
from the Accelerate run. Rank 0 writes every run's losses to --out.
"""
import argparse
import json
import os

import torch

CLIP = 0.5


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                        torch.nn.Dropout(0.1), torch.nn.Linear(32, 3))

    def forward(self, x, labels=None):
        logits = self.body(x)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}


def training_function(lib, accelerator_kwargs, scheduled=True, save_dir=None):
    accelerator = lib.Accelerator(**accelerator_kwargs)
    lib.set_seed(42)
    # the main process writes a file first, the others find it (Accelerate's main_process_first)
    marker = os.path.abspath("main_process_first")
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            open(marker, "w").close()
        saw_main_first = os.path.exists(marker)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.remove(marker)
    accelerator.init_trackers("accelerate_style_train", {"lr": 3e-2})
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    train_dl = torch.utils.data.DataLoader(Pairs(44, 0), batch_size=4, shuffle=True)
    eval_dl = torch.utils.data.DataLoader(Pairs(21, 1), batch_size=4, shuffle=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 6))
    if scheduled:
        model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                             scheduler)
    else:
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    losses, lrs, accuracy, seen, order, eval_ids = [], [], [], [], [], []

    def train_epoch():
        model.train()
        for batch in train_dl:
            order.append(batch.pop("idx").tolist())
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs["loss"]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                if scheduled:
                    scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
            lrs.append(optimizer.param_groups[0]["lr"])
            accelerator.log({"loss": losses[-1]}, step=len(losses))

    for _ in range(2):
        train_epoch()
        model.eval()
        correct, count = 0, 0
        ids = []
        for batch in eval_dl:
            # not tensors: gathered as objects, the repeated samples dropped all the same
            ids += accelerator.gather_for_metrics(batch.pop("idx").tolist())
            with torch.no_grad():
                logits = model(**batch)["logits"]
            predictions, references = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
            correct += (predictions == references).sum().item()
            count += len(references)
        accuracy.append(correct / count)
        seen.append(count)
        eval_ids.append(ids)
    resumed = []
    if save_dir is not None:  # a third epoch, then again from the saved state: the same losses
        accelerator.save_state(save_dir)
        start = len(losses)
        train_epoch()
        resumed.append(losses[start:])
        del losses[start:]
        accelerator.load_state(save_dir)
        train_epoch()
        resumed.append(losses[start:])
        del losses[start:]
    types = lib.DistributedType
    info = {"num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
            "is_a_distributed_type": accelerator.distributed_type in (
                types.MULTI_CPU, types.DEEPSPEED, types.FSDP, types.NO),
            "mixed_precision": str(accelerator.mixed_precision),
            "steps_per_epoch": len(train_dl)}
    engine = getattr(model, "engine", None)
    if engine is not None:
        info.update(stage=engine.zero_optimization_stage(), bf16=engine.bfloat16_enabled(),
                    clip=engine.gradient_clipping(), micro_batch=engine.train_micro_batch_size_per_gpu())
    # the first epoch's samples, step by step: rank 0's batch, then rank 1's
    order = accelerator.gather(torch.tensor(order[:6]).T.contiguous()).T.tolist()
    saw_main_first = accelerator.gather(torch.tensor([int(saw_main_first)])).tolist()
    accelerator.end_training()  # Accelerate's ends its process group: the last collective is above
    return {"losses": losses, "lrs": lrs, "accuracy": accuracy, "seen": seen, "resumed": resumed,
            "main": accelerator.is_main_process, "info": info, "order": order, "eval_ids": eval_ids,
            "saw_main_first": saw_main_first}


def local_sgd_function(lib):
    """by_feature/local_sgd.py's loop, under accelerator.profile() with both kwargs handlers: each
    rank steps on its own gradients, and the parameters are averaged every 2 steps and at the end.
    Returns each rank's losses, how far the ranks' weights were apart after an odd step (> 0: not
    synchronised) and after the block (0), the profiler's event count and accelerator.state."""
    accelerator = lib.Accelerator(kwargs_handlers=[lib.DistributedDataParallelKwargs(),
                                                   lib.ProfileKwargs(record_shapes=True)])
    lib.set_seed(42)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    train_dl = torch.utils.data.DataLoader(Pairs(44, 0), batch_size=4, shuffle=True)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    losses, spread = [], []

    def apart():  # the largest difference between rank 0's weights and rank 1's
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = accelerator.gather(flat[None])
        return (both[0] - both[1]).abs().max().item()

    with accelerator.profile() as prof:
        with lib.LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as local_sgd:
            for step, batch in enumerate(train_dl):
                batch.pop("idx")
                with accelerator.accumulate(model):
                    loss = model(**batch)["loss"]
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    local_sgd.step()
                losses.append(accelerator.gather(loss.detach()[None]).tolist())
                if step == 2:
                    spread.append(apart())
    spread.append(apart())
    state = accelerator.state
    return {"losses": losses, "spread": spread, "events": len(prof.key_averages()) > 0,
            "state": [state.distributed_type.value, state.num_processes, state.process_index,
                      state.local_process_index, torch.device(state.device).type,
                      str(state.mixed_precision)],
            "state_repr": repr(state)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=("accelerate", "minizero"), required=True)
    p.add_argument("--variants", default="ddp")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = {}
    save = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"state_{args.peer}")
    lib = argparse.Namespace()
    if args.peer == "accelerate":
        from accelerate import Accelerator, DistributedType
        from accelerate.local_sgd import LocalSGD
        from accelerate.utils import DistributedDataParallelKwargs, ProfileKwargs, set_seed
        lib.Accelerator, lib.DistributedType, lib.set_seed = Accelerator, DistributedType, set_seed
        lib.LocalSGD, lib.ProfileKwargs = LocalSGD, ProfileKwargs
        lib.DistributedDataParallelKwargs = DistributedDataParallelKwargs
        # first: Accelerate's end_training ends the process group
        runs["local_sgd"] = local_sgd_function(lib)
        runs["ddp"] = training_function(lib, {"gradient_accumulation_steps": 4}, save_dir=save)
    else:
        from minizero.accelerate import Accelerator, DeepSpeedPlugin, DistributedType
        from minizero.accelerate import FullyShardedDataParallelPlugin
        from minizero.accelerate.local_sgd import LocalSGD
        from minizero.accelerate.utils import DistributedDataParallelKwargs, ProfileKwargs, set_seed
        lib.Accelerator, lib.DistributedType, lib.set_seed = Accelerator, DistributedType, set_seed
        lib.LocalSGD, lib.ProfileKwargs = LocalSGD, ProfileKwargs
        lib.DistributedDataParallelKwargs = DistributedDataParallelKwargs
        runs["article"] = training_function(lib, {})  # the launcher's variables: the config file
        for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
            del os.environ[name]
        runs["local_sgd"] = local_sgd_function(lib)  # DDP, as Accelerate's above
        for variant in args.variants.split(","):
            kwargs = {"gradient_accumulation_steps": 4}
            if variant.startswith("zero"):
                kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=int(variant[-1]), gradient_clipping=CLIP)
            elif variant == "fsdp":
                kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")
            runs[variant] = training_function(lib, kwargs,
                                              save_dir=save if variant == "ddp" else None)
    if runs["ddp" if "ddp" in runs else next(iter(runs))]["main"]:
        with open(args.out, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
